// Tuning runs in the browser: the runs and the form on a deployment's page, and
// one run's page (its trials, the trade-off charts, the best plan, apply).
// Figures come from the REST API; progress follows the deployment's websocket
// group (type "tuning").
"use strict";

(() => {
  const { api, text } = Gantry;
  const ACTIVE = ["queued", "running", "cancelling"];
  const COLORS = ["#2457c5", "#c4320a", "#087443", "#6938ef", "#b54708", "#0e7090", "#c11574", "#344054"];

  function number(value, digits = 2) {
    return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
  }

  function progressWords(progress) {
    if (!progress || !progress.state) return "";
    const trial = progress.trial === undefined ? "" : `trial ${progress.trial}: `;
    const elapsed = progress.elapsed_s === undefined ? "" : `, ${progress.elapsed_s} s`;
    const of = progress.trial_s ? ` of ${progress.trial_s} s` : "";
    return `${trial}${progress.state}${elapsed}${of}`;
  }

  function best(run) {
    return run.trials.find((t) => t.number === run.result.best);
  }

  function cell(content, className) {
    const td = document.createElement("td");
    if (className) td.className = className;
    td.append(content);
    return td;
  }

  // --- on a deployment's page --------------------------------------------------------
  Gantry.tuningRuns = (section, deploymentId) => {
    const rows = document.getElementById("tuning-runs");
    const form = document.getElementById("tuning-form");

    async function loadRuns() {
      const page = await api("GET", `/api/tuning/?deployment=${deploymentId}&limit=20`);
      rows.replaceChildren();
      for (const run of page.results) {
        const row = document.createElement("tr");
        row.dataset.run = run.id;
        const link = text("a", `#${run.id}`);
        link.href = `/tuning/${run.id}/`;
        const top = best(run);
        row.append(cell(link), cell(run.spec.mix.map((m) => `${m.model} ${m.rate}/s`).join(", ")),
                   cell(`${run.spec.search}, ${run.trials.length} of ≤ ${run.spec.max_trials} trials`),
                   cell(text("span", run.status, `status status-${run.status}`)),
                   cell(top ? `${number(top.goodput)} req/s (trial ${top.number})` : "–", "number"),
                   cell(Gantry.when(run.started_at || run.created_at)));
        rows.append(row);
      }
      if (!page.results.length) rows.append(text("td", "no tuning runs yet", "muted"));
    }
    document.addEventListener("gantry:resync", loadRuns);
    document.addEventListener("gantry:tuning", loadRuns);
    loadRuns();
    if (!form) return;

    // A starting point to edit: each alias at 1 request/s with a loose target, and
    // each model's batch size and instance count around what it holds now.
    async function suggest() {
      const [aliases, deployment] = await Promise.all([
        api("GET", `/api/gateway/aliases/?deployment=${deploymentId}&limit=500`),
        api("GET", `/api/deployments/${deploymentId}/`),
      ]);
      const byName = Object.fromEntries(deployment.models.map((m) => [m.triton_name, m]));
      const mix = aliases.results.map((alias) => ({
        model: alias.name,
        rate: 1,
        targets: byName[alias.model]?.kind === "llm"
          ? { time_to_first_token_ms: 1000, inter_token_latency_ms: 100 } : { request_latency_ms: 100 },
      }));
      const space = {};
      for (const model of deployment.models) {
        const batch = model.max_batch_size || 1;
        space[model.triton_name] = {
          max_batch_size: [...new Set([batch, Math.min(batch * 2 || 2, 1024)])],
          instance_count: [...new Set([model.instance_count || 1, (model.instance_count || 1) + 1])],
        };
      }
      if (!form.elements.mix.value) form.elements.mix.value = JSON.stringify(mix, null, 1);
      if (!form.elements.space.value) form.elements.space.value = JSON.stringify(space, null, 1);
    }

    function body(confirm) {
      const parsed = {};
      const errors = {};
      for (const name of ["mix", "space"]) {
        try {
          parsed[name] = JSON.parse(form.elements[name].value);
        } catch (error) {
          errors[name] = [`not JSON: ${error.message}`];
        }
      }
      if (Object.keys(errors).length) throw Object.assign(new Error("invalid"), { errors });
      const spec = { deployment: deploymentId, ...parsed, confirm,
                     trial_s: Number(form.elements.trial_s.value), budget_s: Number(form.elements.budget_s.value),
                     end_on: form.elements.end_on.value };
      if (form.elements.max_trials.value !== "") spec.max_trials = Number(form.elements.max_trials.value);
      return spec;
    }

    const confirmButton = form.querySelector("[data-confirm]");
    async function submit(confirm) {
      const note = form.querySelector("[data-tuning-note]");
      note.hidden = true;
      confirmButton.hidden = true;
      try {
        const run = await api("POST", "/api/tuning/", body(confirm));
        Gantry.showFieldErrors(form, {});
        location.assign(`/tuning/${run.id}/`);
      } catch (error) {
        if (error.code === "confirmation_required") {
          note.textContent = error.message;
          note.hidden = false;
          confirmButton.hidden = false;
          confirmButton.focus();
          return;
        }
        // A rule of one entry (mix[1].targets, space.embed.max_batch_size) is shown by its text box, named.
        const errors = {};
        for (const [path, messages] of Object.entries(error.errors || { form: [error.message] })) {
          const slot = path.startsWith("mix") ? "mix" : path.startsWith("space") ? "space" : path;
          const named = slot === path ? messages : messages.map((m) => `${path}: ${m}`);
          errors[slot] = (errors[slot] || []).concat(named);
        }
        Gantry.showFieldErrors(form, errors);
      }
    }
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      submit(false);
    });
    confirmButton.addEventListener("click", () => submit(true));
    // Opened before this script ran (a slow load): its toggle came before the listener.
    const opener = section.querySelector("#tuning-new");
    if (opener.open) suggest();
    else opener.addEventListener("toggle", suggest, { once: true });
  };

  // --- one run's page ------------------------------------------------------------------
  function trialsTable(table, run) {
    const aliases = run.spec.mix.map((m) => m.model);
    const head = document.createElement("thead");
    const headRow = document.createElement("tr");
    const names = ["Trial", "Settings", "State", "Generation", "GPU memory (GPUs)", "Goodput (req/s)"];
    for (const alias of aliases) names.push(`${alias}: p99 / target (ms)`);
    for (const name of names) {
      const th = text("th", name);
      th.scope = "col";
      headRow.append(th);
    }
    head.append(headRow);
    const body = document.createElement("tbody");
    for (const trial of run.trials) {
      const row = document.createElement("tr");
      row.dataset.trial = trial.number;
      if (trial.number === run.result.best) row.className = "highlight";
      const settings = Object.entries(trial.params).map(([k, v]) => `${k}=${JSON.stringify(v)}`).join(", ");
      const state = trial.reason ? `${trial.status}: ${trial.reason}` : trial.status;
      row.append(cell(`${trial.number}${trial.number === 0 ? " (start)" : ""}`), cell(text("code", settings)),
                 cell(state), cell(trial.generation ?? "–", "number"), cell(number(trial.gpu_share, 3), "number"),
                 cell(number(trial.goodput), "number"));
      for (const alias of aliases) {
        const figures = trial.figures[alias];
        if (!figures) {
          row.append(cell("–"));
          continue;
        }
        const words = Object.entries(figures.p99).map(([name, value]) =>
          `${name.replace(/_ms$/, "")} ${number(value, 1)} / ${figures.targets[name]}`).join(", ");
        row.append(cell(`${words}${figures.met ? "" : " (missed)"}`, figures.met ? "" : "warning"));
      }
      body.append(row);
    }
    if (!run.trials.length) body.append(text("td", "no trial yet", "muted"));
    table.replaceChildren(head, body);
  }

  function changesTable(table, changes) {
    table.replaceChildren();
    if (!changes.length) return;
    const head = table.createTHead().insertRow();
    for (const name of ["Model", "Setting", "Now", "Best plan"]) {
      const th = text("th", name);
      th.scope = "col";
      head.append(th);
    }
    const body = table.createTBody();
    for (const change of changes) {
      const row = body.insertRow();
      row.append(cell(change.model), cell(change.field), cell(JSON.stringify(change.from)),
                 cell(JSON.stringify(change.to)));
    }
  }

  function padded(u, min, max) {
    const pad = (max - min) * 0.1 || Math.abs(max) * 0.1 || 1;
    return [Math.max(0, min - pad), max + pad];
  }

  function scatter(container, title, axes, lines) {
    const box = document.createElement("figure");
    box.className = "chart";
    box.append(text("figcaption", title));
    container.append(box);
    new uPlot({
      mode: 2,
      width: Math.min(560, container.clientWidth || 560),
      height: 240,
      // A margin around the points, so none sits on an edge (and one value still spans a range).
      scales: { x: { time: false, range: padded }, y: { range: padded } },
      axes: [{ label: axes[0] }, { label: axes[1] }],
      series: [{}, ...lines.map((line, i) => ({
        label: line.label, stroke: COLORS[i % COLORS.length], fill: COLORS[i % COLORS.length],
        paths: uPlot.paths.points(), points: { show: false, size: 8 },
        facets: [{ scale: "x", auto: true }, { scale: "y", auto: true }],
      }))],
      legend: { live: false },
    }, [null, ...lines.map((line) => [line.x, line.y])], box);
  }

  function tradeoffs(container, run) {
    container.replaceChildren();
    const measured = run.trials.filter((t) => t.goodput !== null);
    if (!measured.length) {
      container.append(text("p", "no trial measured yet", "muted"));
      return;
    }
    scatter(container, "Goodput against GPU memory, one point per trial", ["GPU memory (GPUs)", "goodput (req/s)"],
            [{ label: "trials", x: measured.map((t) => t.gpu_share), y: measured.map((t) => t.goodput) }]);
    const lines = [];
    for (const entry of run.spec.mix) {
      for (const name of Object.keys(entry.targets)) {
        const points = measured.filter((t) => t.figures[entry.model]?.p99[name] != null);
        lines.push({ label: `${entry.model} ${name.replace(/_ms$/, "")}`, x: points.map((t) => t.number),
                     y: points.map((t) => t.figures[entry.model].p99[name] / entry.targets[name]) });
      }
    }
    scatter(container, "Each model's p99 over its target, per trial (≤ 1 meets it)", ["trial", "p99 / target"], lines);
  }

  Gantry.tuningPage = (id) => {
    const root = document.getElementById("tuning-run");
    const badge = root.querySelector("[data-status]");
    async function refresh() {
      const run = await api("GET", `/api/tuning/${id}/`);
      Gantry.setStatus(badge, run.status);
      document.getElementById("status-message").textContent = run.status_message;
      document.getElementById("progress").textContent = ACTIVE.includes(run.status) ? progressWords(run.progress) : "";
      trialsTable(document.getElementById("trials"), run);
      tradeoffs(document.getElementById("tradeoffs"), run);
      const top = best(run);
      const gain = run.result.gain ? `, ${run.result.gain}× the starting plan's` : "";
      const verdict = document.getElementById("best");
      verdict.className = top && !run.result.met ? "warning" : "muted";
      verdict.textContent = !top
        ? "no trial measured yet"
        : run.result.met
          ? `Trial ${top.number} met every target: ${number(top.goodput)} good requests/s${gain}. What it changes against the starting plan:`
          : `No plan met the targets. The closest, trial ${top.number}, served ${number(top.goodput)} good requests/s (see each model's p99 against its target below). What it changes against the starting plan:`;
      changesTable(document.getElementById("changes"), run.result.changes);
      const cancel = document.getElementById("cancel");
      if (cancel) cancel.disabled = !["queued", "running"].includes(run.status);
      const apply = document.getElementById("apply");
      if (apply) {
        apply.disabled = ACTIVE.includes(run.status) || !top;
        apply.textContent = top && !run.result.met ? "Apply the closest plan…" : "Apply the best plan";
        apply.dataset.confirm = top && !run.result.met
          ? `No plan met the targets. Apply trial ${top.number}'s plan as the deployment's next generation anyway?`
          : "";
      }
      return run;
    }
    async function act(path) {
      const failure = document.getElementById("action-error");
      failure.hidden = true;
      try {
        await api("POST", path);
        await refresh();
        return true;
      } catch (error) {
        failure.textContent = error.message;
        failure.hidden = false;
        return false;
      }
    }
    document.getElementById("cancel")?.addEventListener("click", () => act(`/api/tuning/${id}/cancel/`));
    document.getElementById("apply")?.addEventListener("click", async (event) => {
      const question = event.currentTarget.dataset.confirm;
      if (question && !window.confirm(question)) return;
      if (await act(`/api/tuning/${id}/apply/`)) location.reload();  // the facts name the applied generation
    });
    refresh();
    const deployment = root.dataset.deployment;
    if (!deployment) return;
    let last = "";
    Gantry.live(`/ws/deployments/${deployment}/`, {
      resync: refresh,
      onMessage: (event) => {
        if (event.type !== "tuning" || event.id !== id) return;
        Gantry.setStatus(badge, event.status);
        document.getElementById("status-message").textContent = event.status_message;
        document.getElementById("progress").textContent = ACTIVE.includes(event.status) ? progressWords(event.progress) : "";
        // A trial began or ended, or the run did: read the trials again (not on every heartbeat).
        const moment = `${event.status} ${event.progress.trial} ${event.progress.state}`;
        if (moment !== last) refresh();
        last = moment;
      },
    });
  };
})();
