// Gantry's browser side, what every page shares: REST for reads and actions,
// a websocket for live updates, and the pieces pages build from. On every
// (re)connect a page re-reads current state over REST, then follows the
// socket, so nothing missed while disconnected stays stale. Each page's own
// code is in its file (dashboard.js, deployment.js, build.js, model.js).
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

  // ``watch`` (the dashboard): the deployment ids in view, sent as the socket
  // opens and whenever they change; the live server then forwards only their
  // messages, and names the sequence numbers it left out ("skipped").
  function live(path, { onMessage, resync, indicator, watch }) {
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
        if (watch) socket.send(JSON.stringify({ watch: watch() }));
        setLive("up", "live");
        resync && resync("connect");
      };
      socket.onmessage = (event) => {
        const message = JSON.parse(event.data);
        if (message.type === "hello") {  // where the group's numbering stands as we join
          last = message.seq;
          return;
        }
        for (const seq of message.skipped || message.seqs || []) track(seq);  // left out on purpose
        if (message.type === "skipped" || message.type === "watching") return;
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

  // A moment from the API (ISO 8601, UTC) as every page writes it: "2026-11-28 02:05:10" (UTC,
  // like the server-rendered times; controlplane/formats). ``part``: "time" for the clock alone.
  function when(iso, part) {
    if (!iso) return "–";
    const utc = new Date(iso).toISOString().replace("T", " ").slice(0, 19);
    return part === "time" ? utc.slice(11) : utc;
  }

  function eventRow(event) {
    const row = document.createElement("tr");
    row.dataset.eventId = event.id;
    const what = event.to_status ? `${event.from_status || "–"} → ${event.to_status}` : event.kind;
    row.append(text("td", when(event.at)), text("td", event.source),
               text("td", what), text("td", event.message));
    if (event.data && event.data.log_tail) {
      const details = document.createElement("details");
      details.append(text("summary", "server log"), text("pre", event.data.log_tail));
      row.lastChild.append(details);
    }
    return row;
  }

  // A tab bar (role=tablist, each tab an <a href="#panel"> naming its panel in aria-controls):
  // one panel shown at a time, the one the address names (its own id, or an element inside
  // it), else the first. Without scripts every panel shows, one under another.
  function tabs(bar) {
    const all = [...bar.querySelectorAll("[role=tab]")];
    const panelOf = (tab) => document.getElementById(tab.getAttribute("aria-controls"));
    function show(tab, { focus = false } = {}) {
      for (const other of all) {
        const on = other === tab;
        other.setAttribute("aria-selected", String(on));
        other.tabIndex = on ? 0 : -1;
        panelOf(other).hidden = !on;
      }
      if (focus) tab.focus();
      window.dispatchEvent(new Event("resize"));  // charts drawn while hidden take their width now
    }
    function fromAddress() {
      const target = location.hash.length > 1 ? document.getElementById(decodeURIComponent(location.hash.slice(1))) : null;
      return all.find((tab) => target && panelOf(tab).contains(target)) || all[0];
    }
    for (const tab of all) {
      tab.addEventListener("click", (event) => {
        event.preventDefault();
        history.replaceState(null, "", tab.getAttribute("href"));
        show(tab);
      });
      tab.addEventListener("keydown", (event) => {
        const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
        if (!step) return;
        event.preventDefault();
        show(all[(all.indexOf(tab) + step + all.length) % all.length], { focus: true });
      });
    }
    window.addEventListener("hashchange", () => show(fromAddress()));
    show(fromAddress());
  }

  return { api, csrfToken, text, live, setStatus, swapFromServer, showFieldErrors, newestLast, logView, eventRow, when, tabs };
})();
