"""Browser pages: login, dashboard, model and build forms, the deployment page."""

from __future__ import annotations

import json
import re

import pytest
from django.contrib.auth.models import User

from core.models import Event
from deployments.models import EngineBuild, RegisteredModel
from deployments.services import builds, deployments, telemetry
from deployments.services.placements import PlacementSpec
from tests import factories


def test_model_pages_offer_the_build_form_for_llms_and_the_deploy_form_otherwise(client, operator, llama, minilm):
    client.force_login(operator)
    llm_page = client.get(f"/models/{llama.pk}/").content.decode()
    assert llm_page.count('id="build-form"') == 1 and "/deployments/new/?model=llama" in llm_page
    embedder_page = client.get(f"/models/{minilm.pk}/").content.decode()
    assert "/deployments/new/?model=minilm" in embedder_page and 'id="build-form"' not in embedder_page


def _options(page: str) -> dict:
    start = page.index('<script id="deploy-options" type="application/json">') + len(
        '<script id="deploy-options" type="application/json">'
    )
    return json.loads(page[start : page.index("</script>", start)])


def test_the_deploy_page_offers_inspected_models_with_each_settings_bounds(client, operator, gpu_host, llama, minilm):
    build, _ = builds.build_request(model="llama", host="h100-host", image=factories.IMAGE, spec={}, user=operator)
    EngineBuild.objects.filter(pk=build.pk).update(status="succeeded")
    client.force_login(operator)
    page = client.get("/deployments/new/?model=minilm").content.decode()
    options = _options(page)
    assert options["mode"] == "create" and options["initial"] == [{"model": "minilm"}]
    assert {m["name"]: m["kind"] for m in options["models"]} == {"llama": "llm", "minilm": "embedding"}
    [llm] = [m for m in options["models"] if m["name"] == "llama"]
    assert [b["id"] for b in llm["builds"]] == [build.pk]
    assert options["fields"]["gpu_memory_fraction"] == {"default": 0.1, "min": 0.01, "max": 1.0}
    assert options["fields"]["max_batch_size"] == {"default": 32, "min": 1, "max": 4096}
    assert '<option value="gpu-host">' in page


def test_the_deploy_page_is_for_operators(client, db):
    viewer = User.objects.create_user("just-looking")
    client.force_login(viewer)
    response = client.get("/deployments/new/")
    assert response.status_code == 403 and b"operator" in response.content


def test_registering_a_checkpoint_from_the_models_page(client, operator, host, minilm_path):
    client.force_login(operator)
    form = {"name": "mini", "kind": "embedding", "host": "cpu-host", "path": str(minilm_path)}
    response = client.post("/models/", form)
    model = RegisteredModel.objects.get(name="mini")
    assert response.status_code == 302 and response["Location"] == f"/models/{model.pk}/"
    assert model.inspection == "pending"
    page = client.get(response["Location"]).content.decode()
    assert "Gantry.modelPage" in page and "data-status>pending<" in page
    # Each refusal is shown beside its field, and nothing is written.
    refused = client.post("/models/", {**form, "name": "Bad Name", "path": "/nowhere/at/all"}).content.decode()
    assert refused.count('class="error field-error"') >= 1 and "lowercase" in refused
    taken = client.post("/models/", form).content.decode()
    assert "already" in taken
    assert RegisteredModel.objects.filter(name="mini").count() == 1


def test_the_events_page_filters_by_kind_prefix_and_pages_by_cursor(client, operator, host, minilm):
    deployment = factories.deployment(host=host, user=operator)
    for n in range(105):
        Event.objects.create(kind="test.tick", source="test", message=f"tick {n}", deployment=deployment)
    client.force_login(operator)
    first = client.get("/events/?kind=test.").content.decode()
    assert first.count("<code>test.tick</code>") == 100 and "tick 104" in first and "tick 4<" not in first
    assert "deployment.created" not in first
    older = first[first.index('href="?') + 7 : first.index('" rel="next"')].replace("&amp;", "&")
    second = client.get(f"/events/?{older}").content.decode()
    assert second.count("<code>test.tick</code>") == 5 and "tick 0<" in second and 'rel="next"' not in second
    bad = client.get("/events/?deployment=nope")
    assert bad.status_code == 200 and b"Enter a whole number" in bad.content


def test_build_form_queues_a_build_and_shows_its_page(client, operator, llama):
    client.force_login(operator)
    form = {"build": "1", "host": "h100-host", "image": factories.IMAGE, "dtype": "float16", "quantization": "none",
            "gemm_plugin": "auto", "gpt_attention_plugin": "auto", "paged_context_fmha": "on", "max_batch_size": 8,
            "max_input_len": 1024, "max_seq_len": 2048, "max_num_tokens": 8192, "tp_size": 1, "pp_size": 1,
            "workers": 1}  # fmt: skip
    response = client.post(f"/models/{llama.pk}/", form)
    build = EngineBuild.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/builds/{build.pk}/"
    page = client.get(f"/builds/{build.pk}/").content.decode()
    assert "Gantry.buildPage" in page and "TensorRT-LLM 0.16.0" in page
    refused = client.post(f"/models/{llama.pk}/", {**form, "max_seq_len": 100000})
    assert "exceeds the checkpoint&#x27;s max_position_embeddings" in refused.content.decode()
    # Beside its field (the service names it spec.max_seq_len, as the API does).
    assert "max_position_embeddings" in refused.context["build_form"].errors["max_seq_len"][0]


@pytest.mark.parametrize("path", ["/", "/deployments/1/", "/models/1/"])
def test_pages_need_login(client, db, path):
    response = client.get(path)
    assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_dashboard_renders_for_a_signed_in_user(client, operator, host, minilm):
    client.force_login(operator)
    page = client.get("/")
    assert page.status_code == 200
    assert b"cpu-host" in page.content and b"minilm" in page.content


def test_deployment_page_shows_the_gpu_plan(client, operator, gpu_host, minilm):

    factories.surveyed()
    deployment = deployments.deployment_create(
        name="g", hosts=["gpu-host"], placements=[PlacementSpec(model="minilm")], user=operator
    )
    client.force_login(operator)
    page = client.get(f"/deployments/{deployment.pk}/").content.decode()
    assert "GPU plan" in page and "NVIDIA H100 80GB HBM3" in page and "within headroom" in page
    # The change form starts from the deployment's placements; the charts load the last hour.
    assert 'id="change-form"' in page and 'id="charts"' in page and "vendor/uPlot.iife.min.js" in page
    start = page.index('<script id="change-options" type="application/json">')
    options = json.loads(page[page.index(">", start) + 1 : page.index("</script>", start)])
    assert options["mode"] == "change" and options["deploymentId"] == deployment.pk
    assert [m["model"] for m in options["initial"]] == ["minilm"]


def test_the_dashboard_splits_each_gpu_by_the_models_meant_to_run_there(client, operator, gpu_host, minilm):
    running = factories.deployment(host=gpu_host, name="on", models=["minilm"], gpu_memory_fraction=0.25, user=operator)
    factories.deployment_in(running, "launching")
    factories.deployment(host=gpu_host, name="off", models=["minilm"], gpu_memory_fraction=0.5, user=operator)
    client.force_login(operator)
    page = client.get("/").content.decode()
    assert 'data-gpu="gpu-host:0"' in page
    assert "25.0% placed" in page and 'title="on r1 / minilm: 25.0%"' in page
    assert "off / minilm" not in page  # a stopped deployment holds no memory
    assert f'data-sparkline="{running.pk}"' in page


def test_rates_sum_each_deployments_models_per_scrape(api, operator, host, minilm):
    deployment = factories.deployment(host=host, user=operator)
    telemetry.metrics_record(deployment_id=deployment.pk, models={"a": {"request_rate": 1.5}, "b": {}}, gpus={})
    telemetry.metrics_record(
        deployment_id=deployment.pk, models={"a": {"request_rate": 2.0}, "b": {"request_rate": 0.5}}, gpus={}
    )
    [row] = api.get("/api/deployments/rates/?minutes=5").data
    assert row["deployment"] == deployment.pk
    assert [p["request_rate"] for p in row["points"]] == [1.5, 2.5]
    assert api.get("/api/deployments/rates/?minutes=61").status_code == 400


def test_the_builds_page_filters_by_status_and_pages_by_cursor(client, operator, llama, builder_images):
    for n in range(3):
        builds.build_request(
            model="llama", host="h100-host", image=factories.IMAGE, spec={"max_batch_size": n + 1}, user=operator
        )
    EngineBuild.objects.filter(spec__max_batch_size=2).update(status="failed")
    client.force_login(operator)
    page = client.get("/builds/?status=failed").content.decode()
    assert page.count("data-status>failed<") == 1 and "data-status>pending<" not in page
    every = client.get("/builds/").content.decode()
    assert every.count("<code>" + factories.IMAGE + "</code>") == 3 and 'rel="next"' not in every
    assert b"Select a valid choice" in client.get("/builds/?status=sleeping").content


def test_the_dashboard_shows_a_page_of_a_large_fleet_with_its_summary_and_a_search(client, operator, host, minilm):
    from deployments.models import Deployment, Replica

    for n in range(60):
        row = Deployment.objects.create(name=f"svc-{n:02d}", status="ready" if n % 2 else "stopped")
        if n % 2:
            ports = {"http_port": 20000 + 3 * n, "grpc_port": 20001 + 3 * n, "metrics_port": 20002 + 3 * n}
            Replica.objects.create(deployment=row, serial=1, host=host, generation=1, status="ready", **ports)
    client.force_login(operator)
    page = client.get("/").content.decode()
    assert page.count('<tr data-deployment="') == 50  # a page, not the fleet
    assert "1–50 of 60" in page and "page=2" in page
    assert '<a href="?status=ready">30 ready</a>' in page and "30 of 30 ready" in page
    found = client.get("/?q=svc-1&status=ready").content.decode()
    names = sorted(set(re.findall(r">(svc-\d\d)</a>", found)))
    assert names == ["svc-11", "svc-13", "svc-15", "svc-17", "svc-19"]
    on_host = client.get(f"/?host={host.name}").content.decode()
    assert on_host.count('<tr data-deployment="') == 30
    assert "No deployment matches." in client.get("/?q=nothing-like-it").content.decode()


def test_the_rates_and_the_list_answer_for_the_rows_in_view_only(api, host, minilm, operator):
    from deployments.models import MetricSample

    first = factories.deployment(host=host, name="one", user=operator)
    second = factories.deployment(host=host, name="two", user=operator)
    for row in (first, second):
        MetricSample.objects.create(deployment=row, kind="model", subject="minilm", values={"request_rate": 2.0})
    rates = api.get(f"/api/deployments/rates/?ids={second.pk}").data
    assert [r["deployment"] for r in rates] == [second.pk]
    listed = api.get(f"/api/deployments/?ids={first.pk}").data["results"]
    assert [d["name"] for d in listed] == ["one"]
    refused = api.get("/api/deployments/?ids=1,x")
    assert refused.status_code == 400 and "ids" in refused.data["errors"]


def test_registering_a_hub_model_from_the_models_page_starts_its_first_download(client, operator, host):  # noqa: ANN001
    client.force_login(operator)
    form = {"name": "hubbed", "kind": "embedding", "host": "cpu-host", "hub_id": "org/tiny", "revision": "v1",
            "allow_patterns": "*.json, *.safetensors", "ignore_patterns": ""}  # fmt: skip
    response = client.post("/models/", form)
    model = RegisteredModel.objects.get(name="hubbed")
    assert response.status_code == 302 and model.path == "" and model.allow_patterns == ["*.json", "*.safetensors"]
    page = client.get(response["Location"]).content.decode()
    assert 'id="downloads" data-active="1"' in page and "org/tiny</code> at v1" in page
    assert 'data-download="' in page and "data-cancel=" in page
    refused = client.post("/models/", {**form, "name": "other", "hub_id": "not a repo id"}).content.decode()
    assert "must be a repository id, owner/name" in refused and RegisteredModel.objects.count() == 1
