// A deployment's metrics as charts (uPlot, from npm: static/vendor/), the last
// hour from the REST API and then live from the deployment's websocket.
// Per model: requests and failures per second, mean queue and compute time per
// request; per GPU: utilization and memory used. The latest figures stay in the
// table beside them, for screen readers and for copying.
"use strict";

Gantry.metricCharts = (container, deploymentId) => {
  const WINDOW_S = 3600;
  const COLORS = ["#2457c5", "#c4320a", "#087443", "#6938ef", "#b54708", "#0e7090", "#c11574"];
  const CHARTS = [
    { key: "request_rate", kind: "model", title: "Requests / s", unit: "/s" },
    { key: "failure_rate", kind: "model", title: "Failures / s", unit: "/s" },
    { key: "queue_ms", kind: "model", title: "Queue time per request (ms)", unit: " ms" },
    { key: "compute_ms", kind: "model", title: "Compute time per request (ms)", unit: " ms" },
    { key: "ttft_p99_ms", kind: "model", title: "Time to first token p99 (ms)", unit: " ms" },
    { key: "itl_p99_ms", kind: "model", title: "Inter-token latency p99 (ms)", unit: " ms" },
    { key: "tokens_per_s", kind: "model", title: "Generated tokens / s", unit: "/s" },
    { key: "kv_cache_used_fraction", kind: "model", title: "KV cache used (%)", unit: "%", scale: 100 },
    { key: "utilization", kind: "gpu", title: "GPU utilization (%)", unit: "%", scale: 100 },
    { key: "memory_used_bytes", kind: "gpu", title: "GPU memory used (GB)", unit: " GB", scale: 1e-9 },
  ];
  // points[kind][subject] = [[t, values], ...] in time order
  const points = { model: new Map(), gpu: new Map() };
  const charts = [];
  const gpuNames = new Map();  // uuid -> a short label

  function add(kind, subject, t, values) {
    if (!points[kind].has(subject)) points[kind].set(subject, []);
    const series = points[kind].get(subject);
    if (series.length && series[series.length - 1][0] >= t) return;  // already have it
    series.push([t, values]);
    const oldest = t - WINDOW_S;
    while (series.length && series[0][0] < oldest) series.shift();
  }

  function label(kind, subject) {
    if (kind === "model") return subject;
    if (!gpuNames.has(subject)) gpuNames.set(subject, `GPU ${gpuNames.size} (${subject.slice(0, 12)})`);
    return gpuNames.get(subject);
  }

  const clock = (seconds) => Gantry.when(new Date(seconds * 1000).toISOString(), "time");

  // uPlot wants one x array and one y array per series, aligned: the union of the times.
  function aligned(chart) {
    const subjects = [...points[chart.kind].keys()];
    const times = [...new Set(subjects.flatMap((s) => points[chart.kind].get(s).map(([t]) => t)))].sort((a, b) => a - b);
    const index = new Map(times.map((t, i) => [t, i]));
    const ys = subjects.map((subject) => {
      const y = new Array(times.length).fill(null);
      for (const [t, values] of points[chart.kind].get(subject)) {
        const value = values[chart.key];
        if (value !== undefined && value !== null) y[index.get(t)] = value * (chart.scale || 1);
      }
      return y;
    });
    return { subjects, data: [times, ...ys] };
  }

  function draw() {
    for (const chart of charts) {
      const { subjects, data } = aligned(chart);
      const key = subjects.join("|");
      chart.empty.hidden = data[0].length > 0;
      chart.box.parentElement.dataset.points = data[0].length;
      if (!data[0].length) {  // no axes over nothing: their labels piled up on an empty plot
        if (chart.plot) chart.plot.destroy();
        chart.plot = null;
        chart.key_ = null;
        continue;
      }
      if (chart.plot && chart.key_ === key) {
        chart.plot.setData(data);
        continue;
      }
      // The series changed (a model or GPU appeared): a new plot.
      if (chart.plot) chart.plot.destroy();
      chart.key_ = key;
      chart.plot = new uPlot({
        width: chart.box.clientWidth || 480,
        height: 170,
        legend: { live: true },
        scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(max, chart.key === "utilization" ? 100 : 0.001)] } },
        // Times as every page writes them (UTC, 24-hour: Gantry.when), ticks on UTC minutes.
        tzDate: (ts) => uPlot.tzDate(new Date(ts * 1000), "Etc/UTC"),
        axes: [{ values: (u, ticks) => ticks.map((t) => clock(t)) },
               { size: 56, values: (u, ticks) => ticks.map((v) => +v.toPrecision(3)) }],
        series: [{ value: (u, t) => (t == null ? "–" : clock(t)) }, ...subjects.map((subject, i) => ({
          label: label(chart.kind, subject),
          stroke: COLORS[i % COLORS.length],
          width: 1.5,
          spanGaps: false,
          points: { size: 4 },
          value: (u, v) => (v == null ? "–" : `${+v.toPrecision(4)}${chart.unit}`),
        }))],
      }, data, chart.box);
    }
  }

  function setUp() {
    container.replaceChildren();
    for (const spec of CHARTS) {
      const figure = document.createElement("figure");
      figure.className = "chart";
      figure.dataset.chart = spec.key;
      const caption = Gantry.text("figcaption", spec.title);
      const box = document.createElement("div");
      const empty = Gantry.text("p", "no samples yet", "muted");
      figure.append(caption, box, empty);
      container.append(figure);
      charts.push({ ...spec, box, empty, plot: null, key_: null });
    }
  }

  async function load() {
    for (const kind of ["model", "gpu"]) points[kind].clear();
    let url = `/api/deployments/${deploymentId}/metrics/?minutes=60&limit=500`;
    const samples = [];
    for (let pages = 0; url && pages < 40; pages++) {
      const page = await Gantry.api("GET", url);
      samples.push(...page.results);
      url = page.next ? new URL(page.next).pathname + new URL(page.next).search : null;
    }
    // Rows come in id order, which is not always time order: add them oldest first.
    const at = (sample) => Date.parse(sample.at) / 1000;
    samples.sort((a, b) => at(a) - at(b));
    for (const sample of samples) add(sample.kind, sample.subject, at(sample), sample.values);
    draw();
  }

  // A websocket "metrics" message: one scrape of every model and GPU.
  function push(message) {
    const t = Date.parse(message.at) / 1000;
    for (const [subject, values] of Object.entries(message.models || {})) add("model", subject, t, values);
    for (const [subject, values] of Object.entries(message.gpus || {})) add("gpu", subject, t, values);
    draw();
  }

  setUp();
  window.addEventListener("resize", () => {
    // A hidden chart (another tab) keeps its size until it is shown.
    for (const chart of charts) if (chart.plot && chart.box.clientWidth) chart.plot.setSize({ width: chart.box.clientWidth, height: 170 });
  });
  return { load, push };
};

// The dashboard's sparklines: each deployment's requests per second over the
// last minutes, from /api/deployments/rates/ and then the dashboard's socket.
Gantry.sparklines = (inView) => {
  const WINDOW_S = 600;
  const series = new Map();  // deployment id -> {times, rates, plot, box, label}
  function ensure(id) {
    if (series.has(id)) return series.get(id);
    const box = document.querySelector(`[data-sparkline="${id}"]`);
    if (!box) return null;
    const entry = { times: [], rates: [], plot: null, box, label: box.parentElement.querySelector("[data-rate]") };
    series.set(id, entry);
    return entry;
  }
  function draw(entry) {
    const oldest = Date.now() / 1000 - WINDOW_S;
    while (entry.times.length && entry.times[0] < oldest) { entry.times.shift(); entry.rates.shift(); }
    const last = entry.rates[entry.rates.length - 1];
    entry.label.textContent = last === undefined ? "–" : (+last.toPrecision(3)).toString();
    entry.box.dataset.points = entry.times.length;
    const data = [entry.times, entry.rates];
    if (entry.plot) { entry.plot.setData(data); return; }
    entry.plot = new uPlot({
      width: 120, height: 24, legend: { show: false }, cursor: { show: false }, select: { show: false },
      axes: [{ show: false }, { show: false }],
      scales: { x: { time: false }, y: { range: (u, min, max) => [0, Math.max(max, 0.001)] } },
      series: [{}, { stroke: "#2457c5", width: 1.25, fill: "rgba(36,87,197,.12)", points: { show: false } }],
    }, data, entry.box);
  }
  function add(id, at, rate) {
    const entry = ensure(id);
    if (!entry) return;
    const t = Date.parse(at) / 1000;
    if (entry.times.length && entry.times[entry.times.length - 1] >= t) return;
    entry.times.push(t);
    entry.rates.push(rate);
    draw(entry);
  }
  async function load() {
    const ids = inView();
    if (!ids.length) return;
    for (const { deployment, points } of await Gantry.api("GET", `/api/deployments/rates/?minutes=10&ids=${ids.join(",")}`)) {
      const entry = ensure(deployment);
      if (!entry) continue;
      entry.times = points.map((p) => Date.parse(p.at) / 1000);
      entry.rates = points.map((p) => p.request_rate);
      draw(entry);
    }
  }
  return { load, add };
};
