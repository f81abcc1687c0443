// Gantry's browser side: REST for reads and actions, a websocket for live
// updates. On every (re)connect the page re-reads current state over REST,
// then follows the socket, so nothing missed while disconnected stays stale.
"use strict";

const Gantry = (() => {
  function csrfToken() {
    const match = document.cookie.match(/(?:^|;\s*)csrftoken=([^;]+)/);
    return match ? decodeURIComponent(match[1]) : "";
  }

  async function api(method, path, body) {
    const options = { method, headers: { "Accept": "application/json" }, credentials: "same-origin" };
    if (method !== "GET") {
      options.headers["X-CSRFToken"] = csrfToken();
      if (body !== undefined) {
        options.headers["Content-Type"] = "application/json";
        options.body = JSON.stringify(body);
      }
    }
    const response = await fetch(path, options);
    const data = await response.json().catch(() => ({}));
    if (!response.ok) {
      const error = new Error(data.detail || `${response.status} ${response.statusText}`);
      error.status = response.status;
      error.code = data.code;  // machine-readable: confirmation_required, conflict, invalid, ...
      error.errors = data.errors;  // each broken rule by field, as the API names it
      throw error;
    }
    return data;
  }

  // A log page comes newest line first; the page shows the newest line last.
  function newestLast(page) {
    return page.results.map((row) => row.line).reverse();
  }

  // A live socket. Each message carries its group's sequence number: a number
  // that stays missing (the channel layer drops messages for a socket that falls
  // behind) or a reconnect makes the page re-read current state over REST
  // (``resync``). While the socket is down, what the page shows is marked stale.
  const GAP_WAIT_MS = 800;  // messages of one group from two processes may arrive out of order
  const RECONNECT_MAX_MS = 750;
  const RECONNECT_JITTER_MS = 250;
  function live(path, { onMessage, resync, indicator }) {
    let delay = 500;
    let last = null;
    let missing = new Set();
    let gapTimer = null;
    function setLive(state, words) {
      document.body.dataset.live = state;
      if (indicator) indicator.textContent = words;
    }
    function checkGap() {
      gapTimer = null;
      if (missing.size) {
        missing = new Set();
        resync && resync("gap");
      }
    }
    function track(seq) {
      if (typeof seq !== "number") return;
      if (last === null || (seq === 1 && last > 1)) {
        if (last !== null) { missing = new Set(); resync && resync("gap"); }  // Redis restarted: numbering anew
        last = seq;
        return;
      }
      if (seq > last) {
        if (seq - last > 100) { last = seq; missing = new Set(); resync && resync("gap"); return; }
        for (let n = last + 1; n < seq; n++) missing.add(n);
        last = seq;
      } else {
        missing.delete(seq);
      }
      if (missing.size && !gapTimer) gapTimer = setTimeout(checkGap, GAP_WAIT_MS);
    }
    function connect() {
      const scheme = location.protocol === "https:" ? "wss" : "ws";
      // The live server is the pages' own address (behind a proxy) or a port of the same host.
      const port = document.body.dataset.livePort;
      const where = port ? `${location.hostname}:${port}` : location.host;
      const socket = new WebSocket(`${scheme}://${where}${path}`);
      socket.onopen = () => {
        delay = 500;
        last = null;
        missing = new Set();
        setLive("up", "live");
        resync && resync("connect");
      };
      socket.onmessage = (event) => {
        const message = JSON.parse(event.data);
        if (message.type === "hello") {  // where the group's numbering stands as we join
          last = message.seq;
          return;
        }
        track(message.seq);
        onMessage(message);
      };
      socket.onclose = () => {
        setLive("down", "not live: reconnecting (what this page shows may be out of date)");
        // Capped low, with jitter: back within 2 s of the live server (or Redis)
        // returning, without every page of a fleet knocking at the same moment.
        setTimeout(connect, delay + Math.random() * RECONNECT_JITTER_MS);
        delay = Math.min(delay * 2, RECONNECT_MAX_MS);
      };
    }
    connect();
  }

  function setStatus(element, status) {
    element.textContent = status;
    element.className = `status status-${status}`;
  }

  function text(tag, value, className) {
    const element = document.createElement(tag);
    element.textContent = value;
    if (className) element.className = className;
    return element;
  }

  // A log in a <pre>: new lines at the bottom, the newest ``keep`` kept, the view
  // scrolled down; with a search box, only the lines holding its text are shown.
  function logView(pre, keep, search) {
    let lines = [];
    let pending = false;
    function draw() {
      pending = false;
      const needle = search ? search.value.trim().toLowerCase() : "";
      const shown = needle ? lines.filter((line) => line.toLowerCase().includes(needle)) : lines;
      pre.textContent = shown.join("\n");
      pre.dataset.lines = lines.length;
      pre.dataset.shown = shown.length;
      if (search) search.setAttribute("aria-description", `${shown.length} of ${lines.length} lines`);
      pre.scrollTop = pre.scrollHeight;
    }
    // Batches arriving faster than the screen repaints are drawn once per frame.
    const schedule = () => { if (!pending) { pending = true; requestAnimationFrame(draw); } };
    if (search) search.addEventListener("input", schedule);
    return {
      append(batch) { lines = lines.concat(batch).slice(-keep); schedule(); },
      clear() { lines = []; schedule(); },
    };
  }

  // Replace the element ``id`` with its fresh copy from the server's rendering of this page (no reload).
  async function swapFromServer(id) {
    const response = await fetch(location.href, { credentials: "same-origin" });
    const fresh = new DOMParser().parseFromString(await response.text(), "text/html").getElementById(id);
    const here = document.getElementById(id);
    if (fresh && here) here.replaceWith(fresh);
  }

  // The model page: while its host inspects the checkpoint, follow the inspection and show what it found.
  function modelPage(specFields) {
    const card = document.getElementById("model");
    const badge = document.querySelector("#inspection [data-status]");
    const buildForm = document.getElementById("build-form");
    if (buildForm) checkBuild(buildForm, specFields);
    if (badge.textContent !== "pending") return;
    const timer = setInterval(async () => {
      const model = await api("GET", `/api/models/${card.dataset.id}/`).catch(() => null);
      if (!model || model.inspection === "pending") return;
      clearInterval(timer);
      swapFromServer("model");
    }, 1000);
  }

  // A form's errors as the API names them, each beside its field (``[data-error-for=<name>]``,
  // the field marked aria-invalid) and the rest in ``[data-error-for=form]``. ``where``
  // turns an API path into the form's field name.
  function showFieldErrors(root, errors, where = (path) => path) {
    for (const slot of root.querySelectorAll("[data-error-for]")) slot.textContent = "";
    for (const element of root.querySelectorAll("[aria-invalid]")) element.removeAttribute("aria-invalid");
    const general = [];
    for (const [path, messages] of Object.entries(errors || {})) {
      const name = where(path);
      const slot = root.querySelector(`[data-error-for="${CSS.escape(name)}"]`);
      const element = root.querySelector(`[name="${CSS.escape(name)}"]`);
      if (element) element.setAttribute("aria-invalid", "true");
      if (slot) slot.textContent = messages.join(" ");
      else general.push(`${path}: ${messages.join(" ")}`);
    }
    root.querySelector("[data-error-for=form]").textContent = general.join("\n");
  }

  // The build form: the server's preflight checks it as it changes, names each broken
  // rule beside its field, and says whether an identical engine would be reused.
  function checkBuild(form, specFields) {
    const verdict = document.getElementById("build-verdict");
    let asked = 0;
    let timer = null;
    function body() {
      const value = (name) => {
        const element = form.elements[name];
        if (element.type === "checkbox") return element.checked;
        if (element.type === "number") return element.value === "" ? element.value : Number(element.value);
        return element.value;
      };
      const spec = Object.fromEntries(specFields.map((name) => [name, value(name)]));
      return { model: form.dataset.model, host: value("host"), image: value("image"), force: value("force"), spec };
    }
    const show = (errors) => showFieldErrors(form, errors, (path) => path.replace(/^spec\./, ""));
    async function preflight() {
      const mine = ++asked;
      try {
        const answer = await api("POST", "/api/builds/preflight/", body());
        if (mine !== asked) return;
        show(answer.errors);
        if (!answer.valid) {
          verdict.textContent = "Fix the settings marked before this build can be requested.";
        } else if (answer.reuse && answer.reuse.how === "cached") {
          verdict.textContent = `An identical engine is already built: build ${answer.reuse.build} will be reused (tick "Rebuild even if an identical engine exists" to compile again).`;
        } else if (answer.reuse) {
          verdict.textContent = `An identical build is running: submitting joins build ${answer.reuse.build}.`;
        } else {
          verdict.textContent = `A new engine will be compiled (cache key ${answer.cache_key.slice(0, 12)}…).`;
        }
        verdict.dataset.reuse = answer.reuse ? answer.reuse.how : (answer.valid ? "new" : "invalid");
      } catch (error) {
        if (mine !== asked) return;
        show(error.errors || { form: [error.message] });
        verdict.textContent = "Fix the settings marked before this build can be requested.";
        verdict.dataset.reuse = "invalid";
      }
    }
    const changed = () => { clearTimeout(timer); timer = setTimeout(preflight, 250); };
    form.addEventListener("input", changed);
    form.addEventListener("change", changed);
    preflight();
  }

  function eventRow(event) {
    const row = document.createElement("tr");
    row.dataset.eventId = event.id;
    const what = event.to_status ? `${event.from_status || "–"} → ${event.to_status}` : event.kind;
    row.append(text("td", new Date(event.at).toLocaleTimeString()), text("td", event.source),
               text("td", what), text("td", event.message));
    if (event.data && event.data.log_tail) {
      const details = document.createElement("details");
      details.append(text("summary", "server log"), text("pre", event.data.log_tail));
      row.lastChild.append(details);
    }
    return row;
  }

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
                 text("td", new Date(revision.created_at).toLocaleString()),
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
    function showReadiness(status) {
      const running = ["ready", "degraded", "updating"].includes(status);
      for (const badge of document.querySelectorAll("[data-model-ready]")) {
        const ready = readiness[badge.dataset.modelReady];
        badge.hidden = !running;
        const words = ready === true ? "ready" : ready === false ? "not ready" : "checking";
        badge.textContent = words;
        badge.className = `status model-ready status-${ready === true ? "ready" : ready === false ? "failed" : "pending"}`;
      }
    }
    function render(deployment) {
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
    function addEvent(event) {
      if (!events.querySelector(`[data-event-id="${event.id}"]`)) events.prepend(eventRow(event));
    }
    async function refresh() {
      render(await api("GET", `/api/deployments/${id}/`));
      events.replaceChildren();
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
        }
        if (event.type === "log") appendLog(event.lines);
        if (event.type === "models") {
          Object.assign(readiness, event.ready);
          showReadiness(badge.textContent);
        }
        if (event.type === "host") render(await api("GET", `/api/deployments/${id}/`));  // its host went or came back
        // Load tests of this deployment follow its group; their section listens (static/loadtests.js).
        if (event.type === "loadtest") document.dispatchEvent(new CustomEvent("gantry:loadtest", { detail: event }));
        if (event.type !== "event") return;
        addEvent(event);
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

  function renderMetrics(at, models) {
    const body = document.getElementById("metrics");
    const format = (value, digits) => (value === undefined ? "–" : Number(value).toFixed(digits));
    const memory = (value) => (value === undefined ? "–" : `${(value / 2 ** 30).toFixed(2)} GiB`);
    body.replaceChildren(...Object.entries(models).map(([name, m]) => {
      const row = document.createElement("tr");
      row.append(text("td", name), text("td", format(m.request_rate, 2)), text("td", format(m.failure_rate, 2)),
                 text("td", format(m.queue_ms, 2)), text("td", format(m.compute_ms, 2)),
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
    document.getElementById("metrics-at").textContent = new Date(at).toLocaleTimeString();
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

  function dashboard() {
    function setBadge(id, status) {
      const badge = document.querySelector(`[data-deployment="${id}"] [data-status]`);
      if (badge) setStatus(badge, status);
    }
    const sparklines = window.uPlot && Gantry.sparklines ? Gantry.sparklines() : null;
    async function refresh() {
      const page = await api("GET", "/api/deployments/?limit=500");
      for (const deployment of page.results) setBadge(deployment.id, deployment.shown_status);
      if (sparklines) await sparklines.load();
    }
    // A host's beat: what each of its GPUs uses and how busy it is.
    function showGpus(beat) {
      const row = document.querySelector(`[data-host="${beat.host}"]`);
      const time = row && row.querySelector("[data-beat]");
      if (time) time.textContent = new Date(beat.at).toLocaleTimeString();
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

  return { api, text, live, setStatus, swapFromServer, showFieldErrors, deploymentPage, buildPage, modelPage, dashboard };
})();
