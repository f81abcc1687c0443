// A deployment's page: status, actions, models, revisions, timeline, server log and
// metrics followed live, and its playgrounds (chat, embed, rerank).
"use strict";

(() => {
  const { api, csrfToken, eventRow, live, logView, newestLast, setStatus, text } = Gantry;

  // What changed from one generation's models to the next: added, removed, and each changed setting.
  function differences(before, after) {
    const byName = (models) => Object.fromEntries(models.map((m) => [m.triton_name, m]));
    const old = byName(before || []);
    const now = byName(after);
    const lines = [];
    for (const name of Object.keys(now)) {
      if (!(name in old)) { lines.push(`+ ${name}`); continue; }
      for (const key of Object.keys(now[name])) {
        const a = JSON.stringify(old[name][key]);
        const b = JSON.stringify(now[name][key]);
        if (a !== b) lines.push(`${name}.${key}: ${a} → ${b}`);
      }
    }
    for (const name of Object.keys(old)) if (!(name in now)) lines.push(`− ${name}`);
    return lines;
  }

  function renderRevisions(body, revisions, current, canOperate, rollBack) {
    body.replaceChildren(...revisions.slice().reverse().map((revision, i, newestFirst) => {
      const previous = newestFirst[i + 1];
      const row = document.createElement("tr");
      const changed = previous ? differences(previous.models, revision.models) : ["first generation"];
      const state = revision.generation === current ? `${revision.status} (serving)` : revision.status;
      row.append(text("td", String(revision.generation)), text("td", state),
                 text("td", Gantry.when(revision.created_at)),
                 text("td", revision.models.map((m) => m.triton_name).join(", ")));
      const what = document.createElement("td");
      what.append(...changed.map((line) => text("div", line)));
      if (revision.message) what.append(text("div", revision.message, "muted"));
      row.append(what);
      const cell = document.createElement("td");
      if (canOperate) {
        const button = text("button", "Roll back to this", "secondary");
        button.type = "button";
        button.dataset.generation = revision.generation;
        button.dataset.current = revision.generation === current ? "1" : "";
        button.addEventListener("click", () => rollBack(revision.generation));
        cell.append(button);
      }
      row.append(cell);
      return row;
    }));
  }

  function deploymentPage(id) {
    const badge = document.querySelector("#deployment [data-status]");
    const message = document.getElementById("status-message");
    const desired = document.getElementById("desired");
    const events = document.getElementById("events");
    const indicator = document.getElementById("live-indicator");
    const actionError = document.getElementById("action-error");
    const serverLog = document.getElementById("server-log");

    const serverLines = logView(serverLog, 500);
    const appendLog = (lines) => serverLines.append(lines);

    // The server says which actions the deployment allows now; the page keeps no state table.
    let allowed = {};
    function enableActions(actions) {
      allowed = actions;
      for (const action of ["start", "stop", "restart", "delete"]) {
        const button = document.getElementById(action);
        if (button) button.disabled = !actions[action];
      }
      for (const button of document.querySelectorAll("#revisions button[data-generation]")) {
        button.disabled = !actions.rollback || button.dataset.current === "1";
      }
    }
    function showError(error) {
      actionError.textContent = error.message;
      actionError.hidden = false;
    }
    async function loadRevisions(current) {
      const page = await api("GET", `/api/deployments/${id}/revisions/?limit=500`);
      renderRevisions(document.getElementById("revisions"), page.results, current, canOperate, async (generation) => {
        actionError.hidden = true;
        try {
          render(await api("POST", `/api/deployments/${id}/rollback/`, { generation }));
        } catch (error) {
          showError(error);
        }
      });
      enableActions(allowed);
    }
    const canOperate = Boolean(document.getElementById("start"));
    let shownGeneration = null;
    // The playgrounds answer only from a ready server: say so instead of failing on a press.
    function enablePlaygrounds(status) {
      const ready = status === "ready";
      for (const button of document.querySelectorAll("#chat-send, #embed, #rerank")) {
        if (!button.dataset.busy) button.disabled = !ready;
      }
      for (const note of document.querySelectorAll("[data-playground-note]")) {
        note.hidden = ready;
        note.textContent = `The deployment is ${status}: this playground answers once it is ready.`;
      }
    }
    // Each model's readiness as Triton last said it, while the server runs.
    const readiness = {};
    // While the server loads, each model says whether it is in yet: what the deployment waits for.
    function showReadiness(status) {
      const loading = status === "loading";
      const running = loading || ["ready", "degraded", "updating"].includes(status);
      for (const badge of document.querySelectorAll("[data-model-ready]")) {
        const ready = readiness[badge.dataset.modelReady];
        badge.hidden = !running;
        const waiting = ready !== true && (loading || ready === undefined);
        badge.textContent = ready === true ? "ready" : waiting ? (loading ? "loading" : "checking") : "not ready";
        badge.className = `status model-ready status-${ready === true ? "ready" : waiting ? "loading" : "failed"}`;
      }
    }
    // One row per replica: where it runs, what it serves, and what it holds now.
    function renderReplicas(deployment) {
      const body = document.querySelector("#replicas tbody");
      if (!body) return;
      // Ejections are counted from the timeline when the page is drawn; kept as they were.
      const ejections = Object.fromEntries([...body.querySelectorAll("tr[data-replica]")].map(
        (row) => [row.dataset.replica, row.querySelector("[data-ejections]")?.textContent ?? "0"]));
      body.replaceChildren(...deployment.replica_set.map((r) => {
        const row = document.createElement("tr");
        row.dataset.replica = r.serial;
        const gpus = Object.entries(r.gpus).map(([own, host]) => `${own}→${host}`).join(", ") || "CPU";
        const cells = [`r${r.serial}`, r.host, gpus, r.threads === null ? "–" : String(r.threads), String(r.generation),
          null, `${r.http_port}/${r.grpc_port}/${r.metrics_port}`, (r.in_flight ?? 0).toFixed(1), ejections[r.serial] ?? "0"];
        cells.forEach((value, i) => {
          const cell = document.createElement("td");
          if (i === 5) {
            const status = document.createElement("span");
            setStatus(status, r.shown_status);
            // Out of balancing, answering what it holds until that ends or its drain timeout comes.
            if (r.shown_status === "draining") status.textContent = `draining (${Math.round(r.in_flight ?? 0)} in flight)`;
            cell.append(status);
            // Its host downloads a hub model it lacks first: how far, as the host last said.
            if (r.shown_status === "fetching") cell.append(" ", text("small", r.status_message, "muted"));
          } else cell.textContent = value;
          if (i === 8) cell.dataset.ejections = "";
          row.append(cell);
        });
        return row;
      }));
    }
    const scaleInput = document.getElementById("scale-replicas");
    function render(deployment) {
      renderReplicas(deployment);
      document.getElementById("replicas-wanted").textContent = deployment.replicas;
      document.getElementById("autoscale-words").textContent = deployment.autoscale.words;
      if (scaleInput && document.activeElement !== scaleInput) scaleInput.value = deployment.replicas;
      for (const model of deployment.models) readiness[model.triton_name] = model.ready;
      showReadiness(deployment.shown_status);
      enableActions(deployment.actions);
      enablePlaygrounds(deployment.shown_status);
      setStatus(badge, deployment.shown_status);
      message.textContent = deployment.status_message;
      desired.textContent = deployment.desired_state;
      if (deployment.generation !== shownGeneration) {
        shownGeneration = deployment.generation;
        loadRevisions(deployment.generation);
      }
    }
    // A one-replica deployment's status moves with its replica's, in the same words: the
    // replica's row says both, rather than two rows saying one thing.
    const replicaMoves = [];
    function sameMove(event) {
      if (event.kind !== "deployment.status") return null;
      const at = Date.parse(event.at);
      return replicaMoves.find((move) => move.message.endsWith(`: ${event.message}`) && Math.abs(move.at - at) < 2000);
    }
    function addEvent(event) {
      if (events.querySelector(`[data-event-id="${event.id}"]`)) return;
      const same = sameMove(event);
      if (same) {
        same.row.children[2].textContent += ` (deployment → ${event.to_status})`;
        return;
      }
      const row = eventRow(event);
      if (event.kind === "replica.status") {
        replicaMoves.push({ message: event.message, at: Date.parse(event.at), row });
        if (replicaMoves.length > 50) replicaMoves.shift();
      }
      events.prepend(row);
    }
    async function refresh() {
      render(await api("GET", `/api/deployments/${id}/`));
      events.replaceChildren();
      replicaMoves.length = 0;
      (await api("GET", `/api/deployments/${id}/events/`)).results.reverse().forEach(addEvent);
      const latest = {};
      const samples = await api("GET", `/api/deployments/${id}/metrics/?minutes=5&kind=model&ordering=-id&limit=100`);
      for (const sample of samples.results) latest[sample.subject] ??= sample;
      serverLines.clear();
      appendLog(newestLast(await api("GET", `/api/deployments/${id}/log/?limit=200`)));
      const at = Object.values(latest).map((s) => s.at).sort().pop();
      if (at) renderMetrics(at, Object.fromEntries(Object.entries(latest).map(([k, s]) => [k, s.values])));
      if (charts) await charts.load();
    }
    // Replicas whose last scrape failed: the cause above the charts, not a flat line.
    const failedScrapes = new Map();
    function showScrapeProblems() {
      const problem = document.getElementById("metrics-problem");
      problem.hidden = failedScrapes.size === 0;
      problem.textContent = [...failedScrapes.values()].map((e) =>
        `Replica r${e.replica}: no figures since ${Gantry.when(e.at)}: ${e.cause}`).join(" ");
    }
    const chartBox = document.getElementById("charts");
    const charts = chartBox && window.uPlot ? Gantry.metricCharts(chartBox, id) : null;
    live(`/ws/deployments/${id}/`, {
      indicator,
      resync: async (why) => {
        await refresh(why);
        document.dispatchEvent(new CustomEvent("gantry:resync"));
      },
      onMessage: async (event) => {
        if (event.type === "metrics") {
          renderMetrics(event.at, event.models);
          if (charts) charts.push(event);
          failedScrapes.delete(event.replica_id);
          showScrapeProblems();
        }
        if (event.type === "metrics_failed") {
          failedScrapes.set(event.replica_id, event);
          showScrapeProblems();
        }
        if (event.type === "log") appendLog(event.lines);
        if (event.type === "models") {
          Object.assign(readiness, event.ready);
          showReadiness(badge.textContent);
          // Why a replica's models are not ready, as Triton says it (refused, timed out, a load error).
          const cause = document.getElementById("readiness-cause");
          if (event.replica && event.replica.cause !== undefined) {
            cause.hidden = !event.replica.cause;
            cause.textContent = event.replica.cause ? `Replica r${event.replica.serial}: ${event.replica.cause}` : "";
          }
        }
        if (event.type === "host") render(await api("GET", `/api/deployments/${id}/`));  // its host went or came back
        // Load tests of this deployment follow its group; their section listens (static/loadtests.js).
        if (event.type === "loadtest") document.dispatchEvent(new CustomEvent("gantry:loadtest", { detail: event }));
        if (event.type === "tuning") document.dispatchEvent(new CustomEvent("gantry:tuning", { detail: event }));
        if (event.type !== "event") return;
        addEvent(event);
        if (event.kind === "replica.status" || event.kind === "replica.draining") {
          renderReplicas(await api("GET", `/api/deployments/${id}/`));
          return;
        }
        if (event.to_status) {
          setStatus(badge, event.to_status);
          enablePlaygrounds(event.to_status);
          showReadiness(event.to_status);
          message.textContent = event.message;
          render(await api("GET", `/api/deployments/${id}/`));
        } else if (event.kind === "deployment.changed" || event.kind === "deployment.rollback") {
          render(await api("GET", `/api/deployments/${id}/`));  // a new generation: its revisions
        }
      },
    });
    for (const action of ["start", "stop", "restart"]) {
      const button = document.getElementById(action);
      if (!button) continue;
      button.addEventListener("click", async () => {
        actionError.hidden = true;
        try {
          render(await api("POST", `/api/deployments/${id}/${action}/`));
        } catch (error) {
          showError(error);
        }
      });
    }
    const scaleForm = document.getElementById("scale-form");
    if (scaleForm) {
      scaleForm.addEventListener("submit", async (submitted) => {
        submitted.preventDefault();
        actionError.hidden = true;
        try {
          render(await api("POST", `/api/deployments/${id}/scale/`, { replicas: Number(scaleInput.value) }));
        } catch (error) {
          showError(error);
        }
      });
    }
    // Empty number fields are sent as null: an empty max turns autoscaling off.
    const autoscaleForm = document.getElementById("autoscale-form");
    if (autoscaleForm) {
      autoscaleForm.addEventListener("submit", async (submitted) => {
        submitted.preventDefault();
        actionError.hidden = true;
        const form = new FormData(autoscaleForm);
        const number = (name) => (form.get(name) === "" ? null : Number(form.get(name)));
        // Without a max, autoscaling is off and its min means nothing: it is not sent.
        const max = number("max_replicas");
        const body = {
          min_replicas: max === null ? null : number("min_replicas"), max_replicas: max, metric: form.get("metric"),
          target: number("target"), cooldown_s: number("cooldown_s"),
        };
        try {
          render(await api("POST", `/api/deployments/${id}/autoscale/`, body));
        } catch (error) {
          showError(error);
        }
      });
    }
    const deleteButton = document.getElementById("delete");
    if (deleteButton) {
      deleteButton.addEventListener("click", async () => {
        if (!confirm(`Delete ${deleteButton.dataset.name}? Its timeline stays; its ports and name are freed.`)) return;
        actionError.hidden = true;
        try {
          await api("DELETE", `/api/deployments/${id}/`);
          location.assign("/");
        } catch (error) {
          showError(error);
        }
      });
    }
    const embedButton = document.getElementById("embed");
    if (embedButton) embedButton.addEventListener("click", () => embed(id, embedButton.dataset.model));
    const rerankButton = document.getElementById("rerank");
    if (rerankButton) rerankButton.addEventListener("click", () => rerank(id, rerankButton.dataset.model));
    if (document.getElementById("chat")) chat(id);
  }

  // Server-sent events from a fetch body: calls onEvent with each "data:" JSON object.
  async function readEvents(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) !== -1) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of block.split("\n")) {
          if (line.startsWith("data:")) onEvent(JSON.parse(line.slice(5)));
        }
      }
    }
  }

  // The LLM chat: messages stream in; Stop aborts the request, which closes the
  // connection, and Gantry's generate action cancels it inside Triton.
  function chat(id) {
    const section = document.getElementById("chat");
    const model = section.dataset.model;
    const log = document.getElementById("chat-log");
    const input = document.getElementById("chat-input");
    const send = document.getElementById("chat-send");
    const stop = document.getElementById("chat-stop");
    const figures = document.getElementById("chat-figures");
    const error = document.getElementById("chat-error");
    const hasTemplate = send.dataset.template === "1";
    const history = [];
    let controller = null;

    function turn(role, content) {
      const element = text("div", content, `turn ${role}`);
      element.dataset.role = role;
      log.append(element);
      log.scrollTop = log.scrollHeight;
      return element;
    }

    async function ask() {
      const content = input.value.trim();
      if (!content) return;
      error.hidden = true;
      figures.textContent = "";
      history.push({ role: "user", content });
      turn("user", content);
      input.value = "";
      const answer = turn("assistant", "");
      const body = {
        model,
        stream: true,
        max_tokens: Number(document.getElementById("chat-max-tokens").value),
        temperature: Number(document.getElementById("chat-temperature").value),
        top_p: Number(document.getElementById("chat-top-p").value),
      };
      if (hasTemplate) body.messages = history.slice();
      else body.prompt = content;
      controller = new AbortController();
      send.disabled = true;
      send.dataset.busy = "1";
      stop.disabled = false;
      const started = performance.now();
      let firstAt = null;
      let tokens = 0;
      try {
        const response = await fetch(`/api/deployments/${id}/generate/`, {
          method: "POST",
          credentials: "same-origin",
          headers: { "Content-Type": "application/json", "X-CSRFToken": csrfToken() },
          body: JSON.stringify(body),
          signal: controller.signal,
        });
        if (!response.ok) {
          const data = await response.json().catch(() => ({}));
          throw new Error(data.detail || `${response.status} ${response.statusText}`);
        }
        await readEvents(response, (event) => {
          if (event.error) throw new Error(event.error);
          if (event.text) {
            if (firstAt === null) firstAt = performance.now();
            tokens += event.tokens || 0;
            answer.textContent += event.text;
            log.scrollTop = log.scrollHeight;
          }
          if (event.done) {
            const rate = event.tokens_per_s === null ? "–" : event.tokens_per_s.toFixed(1);
            figures.textContent = `time to first token ${event.time_to_first_token_ms} ms · ${rate} tokens/s · ` +
              `${event.usage.completion_tokens} tokens (${event.finish_reason})`;
          }
        });
        history.push({ role: "assistant", content: answer.textContent });
      } catch (err) {
        if (err.name === "AbortError") {
          const seconds = firstAt === null ? 0 : (performance.now() - firstAt) / 1000;
          figures.textContent = `stopped after ${tokens} tokens` +
            (firstAt === null ? "" : ` · time to first token ${(firstAt - started).toFixed(0)} ms` +
              (seconds > 0 && tokens > 1 ? ` · ${((tokens - 1) / seconds).toFixed(1)} tokens/s` : ""));
          answer.dataset.stopped = "true";
          history.push({ role: "assistant", content: answer.textContent });
        } else {
          error.textContent = err.message;
          error.hidden = false;
          history.pop();
        }
      } finally {
        controller = null;
        delete send.dataset.busy;
        send.disabled = document.querySelector("#deployment [data-status]").textContent !== "ready";
        stop.disabled = true;
      }
    }

    send.addEventListener("click", ask);
    stop.addEventListener("click", () => controller && controller.abort());
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey) {
        event.preventDefault();
        ask();
      }
    });
  }

  function renderMetrics(at, models) {
    const body = document.getElementById("metrics");
    const format = (value, digits) => (value === undefined ? "–" : Number(value).toFixed(digits));
    const memory = (value) => (value === undefined ? "–" : `${(value / 2 ** 30).toFixed(2)} GiB`);
    body.replaceChildren(...Object.entries(models).map(([name, m]) => {
      const row = document.createElement("tr");
      const pair = (p50, p99) => (p50 === undefined ? "–" : `${format(p50, 1)} / ${format(p99, 1)}`);
      const share = (value) => (value === undefined ? "–" : `${(value * 100).toFixed(1)}%`);
      row.append(text("td", name), text("td", format(m.request_rate, 2)), text("td", format(m.failure_rate, 2)),
                 text("td", format(m.queue_ms, 2)), text("td", format(m.compute_ms, 2)),
                 text("td", pair(m.ttft_p50_ms, m.ttft_p99_ms)), text("td", pair(m.itl_p50_ms, m.itl_p99_ms)),
                 text("td", format(m.tokens_per_s, 1)), text("td", share(m.kv_cache_used_fraction)),
                 text("td", format(m.requests_total, 0)), text("td", format(m.failures_total, 0)),
                 text("td", memory(m.gpu_memory_bytes)));
      return row;
    }));
    // Beside each model's plan: what NVML sees its processes hold now, against the plan.
    for (const cell of document.querySelectorAll("[data-memory-for]")) {
      const used = (models[cell.dataset.memoryFor] || {}).gpu_memory_bytes;
      cell.textContent = memory(used);
      cell.classList.toggle("error", used !== undefined && cell.dataset.budget !== undefined
                            && used > Number(cell.dataset.budget));
    }
    document.getElementById("metrics-at").textContent = Gantry.when(at, "time");
  }

  async function rerank(id, model) {
    const error = document.getElementById("rerank-error");
    const result = document.getElementById("rerank-result");
    const query = document.getElementById("query").value.trim();
    const passages = document.getElementById("passages").value.split("\n").map((t) => t.trim()).filter(Boolean);
    error.hidden = true;
    result.replaceChildren();
    try {
      const data = await api("POST", `/api/deployments/${id}/rerank/`, { query, passages, model });
      const list = document.createElement("ol");
      data.order.forEach((i) => list.append(text("li", `${data.scores[i].toFixed(4)}  ${passages[i]}`)));
      result.append(text("p", `model ${data.model}, best first`), list);
    } catch (err) {
      error.textContent = err.message;
      error.hidden = false;
    }
  }

  async function embed(id, model) {
    const error = document.getElementById("embed-error");
    const result = document.getElementById("embed-result");
    const texts = document.getElementById("texts").value.split("\n").map((t) => t.trim()).filter(Boolean);
    error.hidden = true;
    result.replaceChildren();
    try {
      const data = await api("POST", `/api/deployments/${id}/embed/`, { texts, model });
      const list = document.createElement("ol");
      data.embeddings.forEach((vector, i) => {
        const preview = vector.slice(0, 6).map((x) => x.toFixed(4)).join(", ");
        list.append(text("li", `${texts[i]} → [${preview}, …] (${vector.length} numbers)`));
      });
      const table = document.createElement("table");
      table.className = "similarity";
      const head = document.createElement("tr");
      head.append(text("th", "cosine"));
      texts.forEach((_, j) => head.append(text("th", `#${j + 1}`)));
      table.append(head);
      data.similarity.forEach((row, i) => {
        const tr = document.createElement("tr");
        tr.append(text("th", `#${i + 1}`));
        row.forEach((value) => tr.append(text("td", value.toFixed(3))));
        table.append(tr);
      });
      result.append(text("p", `model ${data.model}, ${data.embeddings[0].length} dimensions`), list, table);
    } catch (err) {
      error.textContent = err.message;
      error.hidden = false;
    }
  }

  Gantry.deploymentPage = deploymentPage;
})();
