"""Browser pages: login, dashboard, model and build forms, the deployment page."""

from __future__ import annotations

import pytest

from deployments.models import EngineBuild
from deployments.services import deployments
from deployments.services.placements import PlacementSpec
from tests import factories


def test_model_pages_offer_the_build_form_for_llms_and_the_deploy_form_otherwise(client, operator, llama, minilm):
    client.force_login(operator)
    llm_page = client.get(f"/models/{llama.pk}/").content.decode()
    assert llm_page.count('id="build-form"') == 1 and llm_page.count('id="deploy-form"') == 1
    assert f'<option value="{factories.IMAGE}">' in llm_page
    assert 'name="engine_build"' in llm_page  # an llm is deployed from one of its builds
    embedder_page = client.get(f"/models/{minilm.pk}/").content.decode()
    assert embedder_page.count('id="deploy-form"') == 1 and 'id="build-form"' not in embedder_page


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

    deployment = deployments.deployment_create(
        name="g", host_name="gpu-host", placements=[PlacementSpec(model="minilm")], user=operator
    )
    client.force_login(operator)
    page = client.get(f"/deployments/{deployment.pk}/").content.decode()
    assert "GPU plan" in page and "NVIDIA H100 80GB HBM3" in page and "within headroom" in page
