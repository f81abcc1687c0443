// The dashboard: hosts' GPU memory bars, deployments' status and request rates, live.
"use strict";

(() => {
  const { api, live, setStatus } = Gantry;

  function dashboard() {
    function setBadge(id, status) {
      const badge = document.querySelector(`[data-deployment="${id}"] [data-status]`);
      if (badge) setStatus(badge, status);
    }
    // The rows in view: only they are read again and followed live (a fleet of
    // thousands is a page of them).
    const inView = () => [...document.querySelectorAll("tr[data-deployment]")].map((row) => Number(row.dataset.deployment));
    const sparklines = window.uPlot && Gantry.sparklines ? Gantry.sparklines(inView) : null;
    async function refresh() {
      const ids = inView();
      if (ids.length) {
        const page = await api("GET", `/api/deployments/?ids=${ids.join(",")}&limit=${ids.length}`);
        for (const deployment of page.results) setBadge(deployment.id, deployment.shown_status);
      }
      if (sparklines) await sparklines.load();
    }
    // A host's beat: what each of its GPUs uses and how busy it is.
    function showGpus(beat) {
      const row = document.querySelector(`[data-host="${beat.host}"]`);
      const time = row && row.querySelector("[data-beat]");
      if (time) time.textContent = Gantry.when(beat.at, "time");
      for (const gpu of beat.gpus) {
        const figure = document.querySelector(`[data-gpu="${beat.host}:${gpu.index}"]`);
        if (!figure) continue;
        const used = gpu.memory_total_bytes ? (100 * gpu.memory_used_bytes) / gpu.memory_total_bytes : 0;
        figure.querySelector("[data-used-bar]").style.width = `${used.toFixed(1)}%`;
        figure.querySelector("[data-used]").textContent = `${used.toFixed(1)}% in use (${(gpu.memory_used_bytes / 1e9).toFixed(1)} GB)`;
        figure.querySelector("[data-util]").textContent = `${gpu.utilization_percent}% busy`;
      }
    }
    live("/ws/dashboard/", {
      indicator: document.getElementById("live-indicator"),
      watch: inView,
      resync: refresh,
      onMessage: (event) => {
        if (event.type === "gpus") showGpus(event);
        if (event.type === "rate" && sparklines) sparklines.add(event.deployment, event.at, event.request_rate);
        if (event.type === "event" && event.deployment && event.to_status) setBadge(event.deployment, event.to_status);
        // A host that went offline (or came back) changes what its deployments show: re-read them.
        if (event.type === "event" && (event.kind === "host.offline" || event.kind === "host.online")) {
          const badge = document.querySelector(`[data-host="${event.host}"] [data-status]`);
          if (badge) {
            badge.textContent = event.kind === "host.offline" ? "offline" : "online";
            badge.className = `status ${event.kind === "host.offline" ? "status-failed" : "status-ready"}`;
          }
          refresh();
        }
      },
    });
  }

  Gantry.dashboard = dashboard;
})();
