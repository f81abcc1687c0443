// Load tests in the browser: the form and runs on a deployment's page, one
// run's page, and runs compared. Figures come from the REST API; progress
// follows the deployment's websocket group (type "loadtest").
"use strict";

(() => {
  const { api, text } = Gantry;
  const COLORS = ["#2457c5", "#c4320a", "#087443", "#6938ef", "#b54708", "#0e7090", "#c11574", "#344054"];

  function number(value, digits = 1) {
    return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
  }

  function statusBadge(status) {
    return text("span", status, `status status-${status}`);
  }

  function workloadWords(w) {
    const bound = w.duration_s ? `${w.duration_s} s` : `${w.request_count} requests`;
    const unit = w.mode === "rate" ? " req/s" : "";
    return `${w.mode} ${w.levels.join(", ")}${unit} · ${bound} each${w.streaming ? " · streaming" : ""}${w.direct ? " · also direct" : ""}${w.native ? " · native ceiling" : ""}`;
  }

  const ACTIVE = ["queued", "running", "cancelling"];
  // What a run is doing while active; once it ended, what it said.
  function stateWords(run) {
    return ACTIVE.includes(run.status) ? progressWords(run.progress) || run.status_message : run.status_message;
  }

  function progressWords(progress) {
    if (!progress || !progress.step) return "";
    const where = `step ${progress.step} of ${progress.steps}: ${progress.target} at ${progress.level}`;
    return progress.state ? `${where}, ${progress.state}` : `${where}, ${progress.elapsed_s} s (bound ${progress.limit_s} s)`;
  }

  // The figures of runs' steps in one table: a row per step.
  function figuresTable(table, runs, columns) {
    const head = document.createElement("thead");
    const headRow = document.createElement("tr");
    for (const name of ["Run", "Target", "Level", ...columns.map((c) => c.label)]) {
      const cell = text("th", name);
      cell.scope = "col";
      headRow.append(cell);
    }
    head.append(headRow);
    const body = document.createElement("tbody");
    for (const run of runs) {
      for (const point of run.points) {
        const row = document.createElement("tr");
        row.append(text("td", `#${run.id}`), text("td", point.target + (point.complete ? "" : " (cut short)")),
                   text("td", point.level));
        for (const column of columns) row.append(text("td", number(point.figures[column.key], 2), "number"));
        body.append(row);
      }
    }
    if (!body.children.length) body.append(text("td", "no step measured yet", "muted"));
    table.replaceChildren(head, body);
  }

  // Latency against throughput: one curve per run and target over its sweep
  // (uPlot's mode 2: each curve has its own x values).
  function curves(container, runs) {
    container.replaceChildren();
    if (!window.uPlot) return;
    const lines = [];
    for (const run of runs) {
      for (const target of ["gateway", "triton", "native"]) {
        const points = run.points.filter((p) => p.target === target && p.figures.request_throughput != null);
        // A curve needs two steps; a single step's figures are in the table.
        if (points.length > 1) lines.push({ label: `#${run.id} ${target}`, points });
      }
    }
    if (!lines.length) return;
    for (const [key, title] of [["request_latency.p99", "p99 latency (ms)"], ["request_latency.p50", "p50 latency (ms)"],
                                ["time_to_first_token.p99", "p99 time to first token (ms)"]]) {
      const shown = lines.filter((line) => line.points.some((p) => p.figures[key] != null));
      if (!shown.length) continue;
      const box = document.createElement("figure");
      box.className = "chart";
      box.append(text("figcaption", `${title} against requests/s`));
      container.append(box);
      const data = [null, ...shown.map((line) => [line.points.map((p) => p.figures.request_throughput),
                                                  line.points.map((p) => p.figures[key])])];
      // Both axes hold every curve's every point: in mode 2 uPlot's own auto range
      // followed the first curve, and a second one (Triton's) ran off the top.
      const upper = (values) => Math.max(0.001, ...values.filter((v) => v != null)) * 1.08;
      const xMax = upper(data.slice(1).flatMap(([xs]) => xs));
      const yMax = upper(data.slice(1).flatMap(([, ys]) => ys));
      new uPlot({
        mode: 2,
        width: Math.min(560, container.clientWidth || 560),
        height: 240,
        scales: { x: { time: false, auto: false, range: [0, xMax] }, y: { auto: false, range: [0, yMax] } },
        axes: [{ label: "requests/s" }, { label: "ms" }],
        series: [{}, ...shown.map((line, i) => ({
          label: line.label, stroke: COLORS[i % COLORS.length], width: 2,
          points: { show: true, size: 7, fill: COLORS[i % COLORS.length] },
          facets: [{ scale: "x", auto: false }, { scale: "y", auto: false }],
        }))],
        legend: { live: false },
        // What the chart shows once drawn, for a reader's check (the browser tests).
        hooks: { draw: [(u) => { box.dataset.xMax = u.scales.x.max; box.dataset.yMax = u.scales.y.max; }] },
      }, data, box);
    }
  }

  function serverTable(table, run) {
    const head = document.createElement("thead");
    head.innerHTML = "<tr><th scope='col'>Step</th><th scope='col'>Model</th><th scope='col'>Requests</th>" +
      "<th scope='col'>Failures</th><th scope='col'>Queue ms</th><th scope='col'>Compute ms</th>" +
      "<th scope='col'>GPU utilization (mean / max)</th><th scope='col'>KV-cache blocks used (max of)</th></tr>";
    const body = document.createElement("tbody");
    for (const point of run.points) {
      const gpus = Object.values(point.server.gpus || {});
      const gpu = gpus.length
        ? gpus.map((g) => `${number(g.utilization_mean * 100, 0)}% / ${number(g.utilization_max * 100, 0)}%`).join(", ")
        : "no GPU";
      const kv = point.server.kv_cache_blocks ? `${point.server.kv_cache_blocks.used_max} of ${point.server.kv_cache_blocks.max}` : "–";
      for (const [model, m] of Object.entries(point.server.models || {})) {
        const row = document.createElement("tr");
        row.append(text("td", `${point.target} at ${point.level}`), text("td", model + (model === run.triton_name ? " (under test)" : "")),
                   text("td", m.requests, "number"), text("td", m.failures, "number"), text("td", number(m.queue_ms, 2), "number"),
                   text("td", number(m.compute_ms, 2), "number"), text("td", gpu), text("td", kv));
        body.append(row);
      }
    }
    table.replaceChildren(head, body);
  }

  // --- a deployment's page: its runs, and the form that starts one ---------------
  Gantry.loadTests = (section, deploymentId) => {
    if (!section) return;
    const rows = document.getElementById("loadtest-runs");
    const compareButton = document.getElementById("loadtest-compare");
    const form = document.getElementById("loadtest-form");
    const kinds = {};  // alias -> kind

    function picked() {
      return [...rows.querySelectorAll("input[type=checkbox]:checked")].map((box) => box.value);
    }
    compareButton.addEventListener("click", () => location.assign(`/loadtests/compare/?ids=${picked().join(",")}`));

    async function loadRuns() {
      const page = await api("GET", `/api/loadtests/?deployment=${deploymentId}&limit=20`);
      rows.replaceChildren();
      for (const run of page.results) {
        const row = document.createElement("tr");
        row.dataset.run = run.id;
        const box = document.createElement("input");
        box.type = "checkbox";
        box.value = run.id;
        box.setAttribute("aria-label", `compare run ${run.id}`);
        box.addEventListener("change", () => { compareButton.disabled = picked().length < 2; });
        const link = text("a", `#${run.id}`);
        link.href = `/loadtests/${run.id}/`;
        const cells = [box, link, text("span", run.alias), text("span", workloadWords(run.workload)),
                       statusBadge(run.status), text("span", stateWords(run)),
                       text("span", Gantry.when(run.started_at || run.created_at))];
        for (const content of cells) {
          const cell = document.createElement("td");
          cell.append(content);
          row.append(cell);
        }
        rows.append(row);
      }
      if (!page.results.length) rows.append(text("td", "no load tests yet", "muted"));
    }

    document.addEventListener("gantry:resync", loadRuns);
    document.addEventListener("gantry:loadtest", (e) => {
      const run = e.detail;
      const row = rows.querySelector(`[data-run="${run.id}"]`);
      if (!row) return loadRuns();
      row.children[4].replaceChildren(statusBadge(run.status));
      row.children[5].textContent = stateWords(run);
    });
    loadRuns();
    if (!form) return;

    async function loadAliases() {
      const [aliases, deployment] = await Promise.all([
        api("GET", `/api/gateway/aliases/?deployment=${deploymentId}&limit=500`),
        api("GET", `/api/deployments/${deploymentId}/`),
      ]);
      const byName = Object.fromEntries(deployment.models.map((m) => [m.triton_name, m.kind]));
      const select = form.elements.model;
      select.replaceChildren();
      for (const alias of aliases.results) {
        kinds[alias.name] = byName[alias.model] || "";
        const option = text("option", `${alias.name} (${alias.model}, ${kinds[alias.name]})`);
        option.value = alias.name;
        select.append(option);
      }
      const note = form.querySelector("[data-loadtest-note]");
      note.hidden = aliases.results.length > 0;
      note.textContent = "Load tests go through the gateway: give one of this deployment's models an alias on the Gateway page first.";
      showKind();
    }

    function showKind() {
      const kind = kinds[form.elements.model.value] || "";
      for (const element of form.querySelectorAll("[data-kind]")) element.hidden = !element.dataset.kind.split(" ").includes(kind);
    }
    form.elements.model.addEventListener("change", showKind);

    async function body(confirm) {
      const kind = kinds[form.elements.model.value];
      const workload = { mode: form.elements["workload.mode"].value };
      const levels = form.elements["workload.levels"].value.split(/[,\s]+/).filter(Boolean);
      workload.levels = levels.map(Number);
      workload[form.elements.bound.value] = Number(form.elements.bound_value.value);
      const numbers = ["input_tokens", "output_tokens", "batch_size", "passages"];
      for (const name of numbers) {
        const input = form.elements[`workload.${name}`];
        if (input.value !== "" && !input.closest("[data-kind]")?.hidden) workload[name] = Number(input.value);
      }
      if (kind === "llm") {
        workload.endpoint = form.elements["workload.endpoint"].value;
        workload.streaming = form.elements["workload.streaming"].checked;
        workload.direct = form.elements["workload.direct"].checked;
        workload.native = form.elements["workload.native"].checked;
      }
      const thresholds = {};
      for (const name of ["time_to_first_token_ms", "inter_token_latency_ms", "request_latency_ms"]) {
        const input = form.elements[`workload.thresholds.${name}`];
        if (input.value !== "" && !input.closest("[data-kind]")?.hidden) thresholds[name] = Number(input.value);
      }
      if (Object.keys(thresholds).length) workload.thresholds = thresholds;
      const file = form.elements.dataset.files[0];
      if (file && !form.elements.dataset.closest("[data-kind]").hidden) {
        workload.dataset = (await file.text()).split(/\r?\n/).filter((line) => line.trim());
      }
      return { deployment: deploymentId, model: form.elements.model.value, workload, confirm };
    }

    const confirmButton = form.querySelector("[data-confirm]");
    async function submit(confirm) {
      const note = form.querySelector("[data-loadtest-note]");
      note.hidden = true;
      confirmButton.hidden = true;
      try {
        const run = await api("POST", "/api/loadtests/", await body(confirm));
        Gantry.showFieldErrors(form, {});
        location.assign(`/loadtests/${run.id}/`);
      } catch (error) {
        if (error.code === "confirmation_required") {
          note.textContent = error.message;
          note.hidden = false;
          confirmButton.hidden = false;
          confirmButton.focus();
          return;
        }
        const errors = error.errors && Object.keys(error.errors).length ? error.errors : { form: [error.message] };
        Gantry.showFieldErrors(form, errors, (path) => (path.startsWith("workload.thresholds") ? "workload.thresholds" : path));
      }
    }
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      submit(false);
    });
    confirmButton.addEventListener("click", () => submit(true));
    loadAliases();
  };

  // Served against native (trtllm-bench on the same engine) at each level both ran.
  function ceilingTable(table, rows) {
    table.closest("section").hidden = !rows.length;
    table.replaceChildren();
    if (!rows.length) return;
    const head = table.createTHead().insertRow();
    for (const name of ["Target", "Level", "output tokens/s served", "native", "served/native",
                        "requests/s served", "native", "served/native"]) {
      const th = text("th", name);
      th.scope = "col";
      head.append(th);
    }
    const body = table.createTBody();
    for (const row of rows) {
      const tr = body.insertRow();
      tr.append(text("td", row.target), text("td", number(row.level, 0), "number"));
      for (const name of ["output_token_throughput", "request_throughput"]) {
        const figures = row[name];
        tr.append(text("td", number(figures.served, 1), "number"), text("td", number(figures.native, 1), "number"),
                  text("td", figures.ratio == null ? "–" : `${figures.ratio.toFixed(2)}×`, "number"));
      }
    }
  }

  // --- one run's page ----------------------------------------------------------------
  // ``columns``: the figures a step shows, as the server names them (loadtests.selectors.COLUMNS).
  Gantry.loadTestPage = (id, columns) => {
    const root = document.getElementById("loadtest");
    const badge = root.querySelector("[data-status]");
    const progress = document.getElementById("progress");
    const message = document.getElementById("status-message");
    function figureOf(summary, path) {
      return path.split(".").reduce((value, part) => (value && typeof value === "object" ? value[part] : undefined), summary);
    }
    async function refresh() {
      const run = await api("GET", `/api/loadtests/${id}/`);
      Gantry.setStatus(badge, run.status);
      message.textContent = run.status_message;
      progress.textContent = ACTIVE.includes(run.status) ? progressWords(run.progress) : "";
      document.getElementById("log-tail").textContent = run.log_tail;
      const generator = run.context.load_generator;
      if (generator) document.getElementById("load-generator").textContent = `${generator.name} ${generator.version}`;
      const shaped = [{ id: run.id, points: run.points.map((p) => ({
        target: p.target, level: p.level, complete: p.complete,
        figures: Object.fromEntries(columns.map((c) => [c.key, figureOf(p.summary, c.key)])),
      })) }];
      figuresTable(document.getElementById("figures"), shaped, columns);
      curves(document.getElementById("curves"), shaped);
      serverTable(document.getElementById("server"), run);
      ceilingTable(document.getElementById("ceiling"), run.ceiling);
      const cancel = document.getElementById("cancel");
      if (cancel) cancel.disabled = !["queued", "running"].includes(run.status);
    }
    const cancel = document.getElementById("cancel");
    if (cancel) {
      cancel.addEventListener("click", async () => {
        const failure = document.getElementById("action-error");
        failure.hidden = true;
        try {
          await api("POST", `/api/loadtests/${id}/cancel/`);
          await refresh();
        } catch (error) {
          failure.textContent = error.message;
          failure.hidden = false;
        }
      });
    }
    refresh();
    const deployment = root.dataset.deployment;
    if (!deployment) return;
    Gantry.live(`/ws/deployments/${deployment}/`, {
      resync: refresh,
      onMessage: (event) => {
        if (event.type !== "loadtest" || event.id !== id) return;
        Gantry.setStatus(badge, event.status);
        progress.textContent = ACTIVE.includes(event.status) ? progressWords(event.progress) : "";
        message.textContent = event.status_message;
        // A step ended or the run did: read its figures.
        if (!event.progress.elapsed_s || !["running"].includes(event.status)) refresh();
      },
    });
  };

  // --- runs compared -------------------------------------------------------------------
  Gantry.comparePage = (compared) => {
    figuresTable(document.getElementById("figures"), compared.runs, compared.columns);
    curves(document.getElementById("curves"), compared.runs);
  };
})();
