// The deploy form: several models on one host's GPUs, each with its own memory
// fraction, GPU ids, batching, queue policy, instances and (for an llm) path.
// As it is filled in, the server's preflight (POST /api/deployments/preflight/)
// checks it with the rules creation uses and draws the GPU plan of the unsaved
// form: a memory bar per GPU split by model, against the headroom. Every error
// is shown beside its field before anything is saved. The same form changes a
// deployment's models (a new generation): mode "change".
"use strict";

Gantry.deployForm = (root, options) => {
  const { api, text } = Gantry;
  const fields = options.fields;  // bounds and defaults, from DeploymentModel
  const NUMBERS = ["gpu_memory_fraction", "instance_count", "max_batch_size", "max_queue_delay_us",
                   "priority_levels", "default_priority_level", "queue_timeout_us", "max_queue_size", "max_seq_len"];
  // An llm's settings (the server says which of its paths takes each).
  const LLM_NUMBERS = ["max_num_sequences", "kv_cache_free_gpu_mem_fraction", "max_tokens_in_paged_kv_cache"];
  const COLORS = ["#2457c5", "#c4320a", "#087443", "#6938ef", "#b54708", "#0e7090", "#c11574"];
  const modelsBox = root.querySelector("[data-models]");
  const planBox = root.querySelector("[data-plan]");
  const summary = root.querySelector("[data-summary]");
  let rows = 0;
  let asked = 0;
  let timer = null;

  function input(row, name, attrs = {}) {
    const element = document.createElement(attrs.tag || "input");
    element.name = `models[${row}].${name}`;
    element.id = `m${row}-${name}`;
    for (const [key, value] of Object.entries(attrs)) if (key !== "tag") element.setAttribute(key, value);
    return element;
  }

  function labelled(row, name, words, element, help) {
    const label = document.createElement("label");
    label.htmlFor = element.id;
    label.append(text("span", words), element);
    if (help) label.append(text("small", help, "muted"));
    label.append(errorSlot(element.name));
    return label;
  }

  function errorSlot(path) {
    const slot = text("span", "", "error field-error");
    slot.dataset.errorFor = path;
    slot.setAttribute("role", "alert");
    return slot;
  }

  function select(row, name, choices, value) {
    const element = input(row, name, { tag: "select" });
    for (const [key, words] of choices) {
      const option = text("option", words);
      option.value = key;
      if (String(key) === String(value)) option.selected = true;
      element.append(option);
    }
    return element;
  }

  function number(row, name, value) {
    const bound = fields[name];
    const step = name.includes("fraction") ? "0.01" : "1";
    return input(row, name, { type: "number", min: bound.min, max: bound.max, step, value: value ?? bound.default });
  }

  function llmPaths(modelName) {
    const model = options.models.find((m) => m.name === modelName);
    if (!model || model.kind !== "llm") return null;
    const paths = [["transformers", "transformers on the python backend (no engine)"],
                   ["llm_api", "TensorRT-LLM's LLM API from the checkpoint (docker runtime)"]];
    for (const build of model.builds) paths.push([`engine:${build.id}`, `engine build ${build.id} (${build.label})`]);
    return paths;
  }

  function addModel(spec = {}) {
    const row = rows++;
    const fieldset = document.createElement("fieldset");
    fieldset.className = "model-row";
    fieldset.dataset.row = row;
    const legend = text("legend", `Model ${row + 1}`);
    fieldset.append(legend);
    const choices = options.models.map((m) => [m.name, `${m.name} (${m.kind}${m.notice ? ", " + m.notice : ""})`]);
    const model = select(row, "model", choices, spec.model || (options.models[0] || {}).name);
    const grid = document.createElement("div");
    grid.className = "grid";
    grid.append(
      labelled(row, "model", "Registered model", model),
      labelled(row, "triton_name", "Name in Triton", input(row, "triton_name", { value: spec.triton_name || "", placeholder: "the model's name" })),
      labelled(row, "gpu_memory_fraction", "GPU memory fraction", number(row, "gpu_memory_fraction", spec.gpu_memory_fraction),
               "of each GPU it runs on"),
      labelled(row, "gpu_ids", "GPU ids", input(row, "gpu_ids", { value: (spec.gpu_ids || []).join(","), placeholder: "all, or e.g. 0,1" })),
      labelled(row, "instance_kind", "Instances on", select(row, "instance_kind", options.instance_kinds, spec.instance_kind || fields.instance_kind.default)),
      labelled(row, "instance_count", "Instance count", number(row, "instance_count", spec.instance_count)),
      labelled(row, "max_batch_size", "Max batch size", number(row, "max_batch_size", spec.max_batch_size)),
      labelled(row, "preferred_batch_sizes", "Preferred batch sizes", input(row, "preferred_batch_sizes", { value: (spec.preferred_batch_sizes || []).join(","), placeholder: "e.g. 4,8" })),
      labelled(row, "max_queue_delay_us", "Max queue delay (µs)", number(row, "max_queue_delay_us", spec.max_queue_delay_us ?? ""),
               "empty: 0 for an LLM (it batches in flight), 2000 for the others"),
      labelled(row, "priority_levels", "Priority levels", number(row, "priority_levels", spec.priority_levels), "0: no priorities"),
      labelled(row, "default_priority_level", "Default priority level", number(row, "default_priority_level", spec.default_priority_level)),
      labelled(row, "queue_timeout_us", "Queue timeout (µs)", number(row, "queue_timeout_us", spec.queue_timeout_us), "0: wait forever"),
      labelled(row, "max_queue_size", "Max queue size", number(row, "max_queue_size", spec.max_queue_size), "0: unbounded"),
      labelled(row, "timeout_action", "Past the queue timeout", select(row, "timeout_action", options.timeout_actions, spec.timeout_action || fields.timeout_action.default)),
      labelled(row, "dtype", "Precision", select(row, "dtype", options.dtypes, spec.dtype || fields.dtype.default)),
      labelled(row, "max_seq_len", "Max tokens per input", number(row, "max_seq_len", spec.max_seq_len),
               "empty: the checkpoint's own"),
    );
    const llm = document.createElement("div");
    llm.className = "grid llm-only";
    const path = spec.engine_build ? `engine:${spec.engine_build}` : spec.llm_api ? "llm_api" : "transformers";
    function drawLlm() {
      llm.replaceChildren();
      const paths = llmPaths(model.value);
      llm.hidden = !paths;
      if (!paths) return;
      llm.append(
        labelled(row, "path", "Served by", select(row, "path", paths, path)),
        labelled(row, "batch_scheduler_policy", "Batch scheduler", select(row, "batch_scheduler_policy", options.scheduler_policies, spec.batch_scheduler_policy || fields.batch_scheduler_policy.default)),
        labelled(row, "max_num_sequences", "Sequences at once", number(row, "max_num_sequences", spec.max_num_sequences), "empty: max batch size"),
        labelled(row, "kv_cache_free_gpu_mem_fraction", "KV-cache share", number(row, "kv_cache_free_gpu_mem_fraction", spec.kv_cache_free_gpu_mem_fraction), "TensorRT-LLM; empty: 0.9"),
        labelled(row, "max_tokens_in_paged_kv_cache", "KV-cache tokens", number(row, "max_tokens_in_paged_kv_cache", spec.max_tokens_in_paged_kv_cache), "TensorRT-LLM; empty: planned"),
        labelled(row, "decoding_mode", "Decoding mode", select(row, "decoding_mode", options.decoding_modes, spec.decoding_mode || fields.decoding_mode.default)),
      );
      for (const [name, words] of [["decoupled", "Stream tokens (decoupled)"], ["enable_kv_cache_reuse", "Reuse KV cache of shared prefixes"]]) {
        const box = input(row, name, { type: "checkbox" });
        box.checked = spec[name] ?? fields[name].default;
        const label = labelled(row, name, words, box);
        label.className = "check";
        llm.append(label);
      }
      llm.append(errorSlot(`models[${row}].engine_build`), errorSlot(`models[${row}].llm_api`));
    }
    model.addEventListener("change", drawLlm);
    drawLlm();
    const remove = text("button", `Remove model ${row + 1}`, "secondary");
    remove.type = "button";
    remove.addEventListener("click", () => { fieldset.remove(); changed(); });
    fieldset.append(grid, llm, errorSlot(`models[${row}]`), remove);
    modelsBox.append(fieldset);
  }

  function list(value) {
    const parts = value.split(",").map((p) => p.trim()).filter((p) => p !== "");
    return parts.every((p) => /^\d+$/.test(p)) ? parts.map(Number) : value;  // the server names a bad one
  }

  function modelBody(fieldset) {
    const get = (name) => fieldset.querySelector(`[name$="].${name}"]`);
    const spec = { model: get("model").value };
    if (get("triton_name").value.trim()) spec.triton_name = get("triton_name").value.trim();
    for (const name of NUMBERS) {
      const value = get(name).value.trim();
      if (value !== "") spec[name] = Number.isNaN(Number(value)) ? value : Number(value);
    }
    spec.instance_kind = get("instance_kind").value;
    spec.timeout_action = get("timeout_action").value;
    spec.dtype = get("dtype").value;
    spec.gpu_ids = list(get("gpu_ids").value);
    spec.preferred_batch_sizes = list(get("preferred_batch_sizes").value);
    const path = get("path");
    if (path) {
      if (path.value === "llm_api") spec.llm_api = true;
      if (path.value.startsWith("engine:")) spec.engine_build = Number(path.value.slice(7));
      spec.batch_scheduler_policy = get("batch_scheduler_policy").value;
      spec.decoupled = get("decoupled").checked;
      spec.enable_kv_cache_reuse = get("enable_kv_cache_reuse").checked;
      spec.decoding_mode = get("decoding_mode").value;
      for (const name of LLM_NUMBERS) {
        const value = get(name).value.trim();
        if (value !== "") spec[name] = Number.isNaN(Number(value)) ? value : Number(value);
      }
    }
    return spec;
  }

  // The body of the create (or change) request; field paths follow the page's rows.
  function body() {
    const fieldsets = [...modelsBox.querySelectorAll("fieldset.model-row")];
    const result = { models: fieldsets.map(modelBody) };
    if (options.mode === "create") {
      for (const name of ["name", "host", "runtime", "image", "placement_policy"]) {
        result[name] = root.querySelector(`[name=${name}]`).value;
      }
      result.physical_gpus = root.querySelector("[name=physical_gpus]").checked;
      const replicas = root.querySelector("[name=replicas]").value.trim();
      result.replicas = replicas === "" || Number.isNaN(Number(replicas)) ? replicas : Number(replicas);
      for (const name of ["shm_size_mib", "log_verbose", "drain_timeout_s"]) {
        const value = root.querySelector(`[name=${name}]`).value.trim();
        if (value !== "") result[name] = Number.isNaN(Number(value)) ? value : Number(value);
      }
    } else {
      Object.assign(result, options.deployment);
    }
    return { result, fieldsets };
  }

  // The server's field paths say models[i] for the i-th model sent; the page's rows keep their own numbers.
  function showErrors(errors, fieldsets) {
    Gantry.showFieldErrors(root, errors, (path) => {
      const match = path.match(/^models\[(\d+)\](.*)$/);
      const row = match && fieldsets[Number(match[1])];
      return row ? `models[${row.dataset.row}]${match[2]}` : path;
    });
  }

  function bytes(n) {
    return n >= 1e9 ? `${(n / 1e9).toFixed(1)} GB` : `${(n / 1e6).toFixed(0)} MB`;
  }

  function drawPlan(plan) {
    planBox.replaceChildren();
    if (!plan.length) {
      planBox.append(text("p", "Nothing on a GPU: this host has no GPUs, or every model runs on the CPU.", "muted"));
      return;
    }
    const names = [...new Set(plan.flatMap((gpu) => gpu.models.map((m) => m.triton_name)))];
    const label = (m) => (m.deployment_id === null ? m.triton_name : `${m.deployment}/${m.triton_name}`);
    for (const gpu of plan) {
      const figure = document.createElement("figure");
      figure.className = "gpu-plan";
      figure.dataset.gpu = gpu.gpu;
      const free = Math.max(0, gpu.headroom - gpu.fraction);
      figure.append(text("figcaption", `GPU ${gpu.gpu}: ${gpu.name}, ${bytes(gpu.memory_total_bytes)}: `
        + `${Math.round(gpu.fraction * 100)}% planned, ${gpu.within_headroom ? `${bytes(free * gpu.memory_total_bytes)} left under` : "over"} `
        + `the ${Math.round(gpu.headroom * 100)}% headroom; ${gpu.processes} server processes`));
      const bar = document.createElement("div");
      bar.className = `memory-bar${gpu.problems.length ? " over" : ""}`;
      bar.setAttribute("role", "img");
      bar.setAttribute("aria-label", gpu.models.map((m) => `${label(m)} ${Math.round(m.share * 100)}%`).join(", "));
      for (const m of gpu.models) {
        const segment = text("span", `${label(m)} ${Math.round(m.share * 100)}%`, "segment");
        segment.style.width = `${Math.min(100, m.share * 100)}%`;
        // Another deployment's share is grey: this form cannot change it.
        segment.style.background = m.deployment_id === null ? COLORS[names.indexOf(m.triton_name) % COLORS.length] : "#667085";
        segment.title = `${label(m)}: ${bytes(m.bytes)}`;
        bar.append(segment);
      }
      const mark = document.createElement("span");
      mark.className = "headroom";
      mark.style.left = `${gpu.headroom * 100}%`;
      mark.title = `headroom limit ${Math.round(gpu.headroom * 100)}%`;
      bar.append(mark);
      const legend = document.createElement("ul");
      legend.className = "plan-legend";
      for (const m of gpu.models) {
        const times = m.instances > 1 && m.share !== m.fraction ? ` × ${m.instances} instances` : "";
        let words = `${label(m)}: ${Math.round(m.fraction * 100)}%${times} = ${bytes(m.bytes)}`;
        if (m.engine_bytes != null) words += `; weights ${bytes(m.engine_bytes)}, KV cache ${m.kv_cache_tokens} tokens (${bytes(m.kv_cache_bytes)})`;
        else if (m.weights_bytes != null) words += `; weights ${bytes(m.weights_bytes)}, KV cache ${bytes(m.kv_cache_bytes)}, activations ${bytes(m.activation_bytes)}`;
        legend.append(text("li", words));
      }
      figure.append(bar, legend);
      for (const problem of gpu.problems) figure.append(text("p", problem, "error"));
      planBox.append(figure);
    }
  }

  async function preflight() {
    const { result, fieldsets } = body();
    const mine = ++asked;
    const request = options.mode === "create" ? result : { ...result, name: "", replaces: options.deploymentId };
    try {
      const answer = await api("POST", "/api/deployments/preflight/", request);
      if (mine !== asked) return;  // a newer edit was already sent
      showErrors(answer.errors, fieldsets);
      drawPlan(answer.plan);
      const warnings = answer.warnings.length ? ` Beside what the hosts run now: ${answer.warnings.join("; ")}.` : "";
      const placed = (answer.replicas || []).filter((r) => r.host)
        .map((r) => `r${r.replica} on ${r.host} GPU ${Object.values(r.gpus || {}).join(", ") || "none (CPU)"}`);
      const where = placed.length ? ` Where the replicas would go now: ${placed.join("; ")}.` : "";
      summary.textContent = (answer.valid ? "The server's checks pass: nothing is saved until you submit."
                                          : `${Object.keys(answer.errors).length} problem(s) to fix before this can be saved.`) + where + warnings;
      summary.className = answer.valid && !warnings ? "muted" : "error";
    } catch (error) {
      if (mine !== asked) return;
      showErrors(error.errors || { form: [error.message] }, fieldsets);
      summary.textContent = "Fix the fields marked before the plan can be drawn.";
      summary.className = "error";
    }
  }

  function changed() {
    clearTimeout(timer);
    timer = setTimeout(preflight, 250);
  }

  async function submit(event) {
    event.preventDefault();
    // What a check still on its way would say is about the form before this submit: drop it.
    clearTimeout(timer);
    asked++;
    const { result, fieldsets } = body();
    const button = root.querySelector("button[type=submit]");
    button.disabled = true;
    try {
      if (options.mode === "create") {
        const created = await api("POST", "/api/deployments/", result);
        location.assign(`/deployments/${created.id}/`);
        return;
      }
      const done = await api("PUT", `/api/deployments/${options.deploymentId}/models/`, { models: result.models });
      summary.textContent = `Generation ${done.generation} asked for: the timeline and Generations show it being applied.`;
      summary.className = "muted";
      options.onChanged && options.onChanged(done);
    } catch (error) {
      showErrors(error.errors || { form: [error.message] }, fieldsets);
      summary.textContent = error.message;
      summary.className = "error";
    } finally {
      button.disabled = false;
    }
  }

  root.addEventListener("input", changed);
  root.addEventListener("change", changed);
  root.addEventListener("submit", submit);
  root.querySelector("[data-add-model]").addEventListener("click", () => { addModel(); changed(); });
  for (const spec of options.initial.length ? options.initial : [{}]) addModel(spec);
  preflight();
  return { reset(specs) { modelsBox.replaceChildren(); rows = 0; for (const spec of specs) addModel(spec); preflight(); } };
};
