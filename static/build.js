// An engine build's page: its status, phase and log followed live.
"use strict";

(() => {
  const { api, eventRow, live, logView, newestLast, setStatus, swapFromServer } = Gantry;

  function buildPage(id) {
    const badge = document.querySelector("#build [data-status]");
    const phase = document.getElementById("phase");
    const message = document.getElementById("status-message");
    const hint = document.getElementById("hint");
    const exitCode = document.getElementById("exit-code");
    const events = document.getElementById("events");
    const log = document.getElementById("build-log");
    const cancel = document.getElementById("cancel");
    const actionError = document.getElementById("action-error");

    const buildLines = logView(log, 5000, document.getElementById("log-search"));
    const appendLog = (lines) => buildLines.append(lines);
    function render(build) {
      setStatus(badge, build.status);
      phase.textContent = build.phase || "waiting for the host";
      message.textContent = build.status_message;
      hint.textContent = build.hint;
      hint.hidden = !build.hint;
      exitCode.textContent = build.exit_code === null ? "–" : build.exit_code;
      document.getElementById("engine-dir").textContent = build.output_dir || "–";
      if (cancel) cancel.disabled = !build.actions.cancel;
      if (build.finished_at && build.artifacts.length && !document.getElementById("artifacts")) {
        swapFromServer("artifacts-section");  // the artifacts table is rendered by the server
      }
    }
    function addEvent(event) {
      if (!events.querySelector(`[data-event-id="${event.id}"]`)) events.prepend(eventRow(event));
    }
    async function refresh() {
      render(await api("GET", `/api/builds/${id}/`));
      events.replaceChildren();
      (await api("GET", `/api/builds/${id}/events/`)).results.reverse().forEach(addEvent);
      buildLines.clear();
      appendLog(newestLast(await api("GET", `/api/builds/${id}/log/?limit=500`)));
    }
    live(`/ws/builds/${id}/`, {
      indicator: document.getElementById("live-indicator"),
      resync: refresh,
      onMessage: async (event) => {
        if (event.type === "log") appendLog(event.lines);
        if (event.type === "build" && event.phase) phase.textContent = event.phase;
        if (event.type !== "event") return;
        addEvent(event);
        if (event.to_status) render(await api("GET", `/api/builds/${id}/`));
      },
    });
    if (cancel) {
      cancel.addEventListener("click", async () => {
        actionError.hidden = true;
        try {
          render(await api("POST", `/api/builds/${id}/cancel/`));
        } catch (error) {
          actionError.textContent = error.message;
          actionError.hidden = false;
        }
      });
    }
  }

  Gantry.buildPage = buildPage;
})();
