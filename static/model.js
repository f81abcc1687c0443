// The model page: the checkpoint's inspection followed live, and the build form checked as you type.
"use strict";

(() => {
  const { api, showFieldErrors, swapFromServer } = Gantry;

  // The model page: while its host inspects the checkpoint, follow the inspection and show what it found.
  function modelPage(specFields) {
    const card = document.getElementById("model");
    const badge = document.querySelector("#inspection [data-status]");
    const buildForm = document.getElementById("build-form");
    if (buildForm) checkBuild(buildForm, specFields);
    followDownloads(card.dataset.id);
    if (badge.textContent !== "pending") return;
    const timer = setInterval(async () => {
      const model = await api("GET", `/api/models/${card.dataset.id}/`).catch(() => null);
      if (!model || model.inspection === "pending") return;
      clearInterval(timer);
      swapFromServer("model");
    }, 1000);
  }

  // Hub downloads: progress redrawn every second while one is active; cancel and
  // "download to" go through the API, as automation's would.
  function followDownloads(id) {
    const section = () => document.getElementById("downloads");
    if (!section()) return;
    const wire = () => {
      section().querySelectorAll("[data-cancel]").forEach((button) => {
        button.addEventListener("click", async () => {
          button.disabled = true;
          await api("POST", `/api/downloads/${button.dataset.cancel}/cancel/`).catch(() => null);
          redraw();
        });
      });
      const said = section().querySelector("[data-error-for=cache]");
      section().querySelectorAll("#cached [data-pin], #cached [data-remove]").forEach((button) => {
        button.addEventListener("click", async () => {
          const path = `/api/models/${id}/copies/${button.closest("tr").dataset.host}/`;
          button.disabled = true;
          try {
            if (button.dataset.pin) await api("PATCH", path, { pinned: button.dataset.pin === "true" });
            else await api("DELETE", path);
            redraw();
          } catch (error) {
            said.textContent = String(error.message || error);
            button.disabled = false;
          }
        });
      });
      const form = section().querySelector("#download-form");
      if (form) {
        form.addEventListener("submit", async (event) => {
          event.preventDefault();
          try {
            await api("POST", `/api/models/${id}/downloads/`, { host: form.elements.host.value });
            redraw();
          } catch (error) {
            showFieldErrors(form, error.errors || { form: [String(error.message || error)] });
          }
        });
      }
    };
    const redraw = async () => {
      await swapFromServer("downloads");
      wire();
    };
    wire();
    setInterval(async () => {
      if (section().dataset.active) {
        await redraw();
        if (!section().dataset.active) swapFromServer("model");
      }
    }, 1000);
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

  Gantry.modelPage = modelPage;
})();
