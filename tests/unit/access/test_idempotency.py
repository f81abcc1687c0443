"""Idempotency-Key: a retried create answers the first success again."""

from __future__ import annotations

from access.models import ApiToken, IdempotentRequest
from deployments.models import Deployment

BODY = {"name": "d", "host": "cpu-host", "models": [{"model": "minilm"}]}


def test_a_retried_create_with_the_same_key_makes_one_deployment(api, host, minilm):  # noqa: ANN001
    first = api.post("/api/deployments/", BODY, format="json", HTTP_IDEMPOTENCY_KEY="create-d-1")
    again = api.post("/api/deployments/", BODY, format="json", HTTP_IDEMPOTENCY_KEY="create-d-1")
    assert first.status_code == again.status_code == 201
    assert again.json() == first.json() and again["Idempotent-Replayed"] == "true"
    assert Deployment.objects.filter(name="d").count() == 1


def test_the_same_key_for_another_body_is_refused(api, host, minilm):  # noqa: ANN001
    api.post("/api/deployments/", BODY, format="json", HTTP_IDEMPOTENCY_KEY="k")
    other = api.post("/api/deployments/", {**BODY, "name": "e"}, format="json", HTTP_IDEMPOTENCY_KEY="k")
    assert other.status_code == 422 and other.json()["code"] == "idempotency_key_reused"
    assert not Deployment.objects.filter(name="e").exists()


def test_a_refused_request_frees_its_key_for_the_corrected_retry(api, host, minilm):  # noqa: ANN001
    refused = api.post("/api/deployments/", {**BODY, "host": "nowhere"}, format="json", HTTP_IDEMPOTENCY_KEY="k")
    assert refused.status_code == 400
    fixed = api.post("/api/deployments/", BODY, format="json", HTTP_IDEMPOTENCY_KEY="k")
    assert fixed.status_code == 201 and "Idempotent-Replayed" not in fixed


def test_a_key_whose_first_request_still_runs_is_a_conflict(api, host, minilm, operator):  # noqa: ANN001
    IdempotentRequest.objects.create(user=operator, key="k", method="POST", path="/api/deployments/", body_digest="x")
    running = api.post("/api/deployments/", BODY, format="json", HTTP_IDEMPOTENCY_KEY="k")
    assert running.status_code in (409, 422)
    assert not Deployment.objects.exists()


def test_a_replayed_token_creation_does_not_show_the_secret_again(api):  # noqa: ANN001
    first = api.post("/api/tokens/", {"name": "ci"}, format="json", HTTP_IDEMPOTENCY_KEY="tok")
    again = api.post("/api/tokens/", {"name": "ci"}, format="json", HTTP_IDEMPOTENCY_KEY="tok")
    assert first.json()["token"].startswith("gt-") and again.json()["token"] is None
    assert ApiToken.objects.count() == 1
    assert first.json()["token"] not in str(IdempotentRequest.objects.values_list("response", flat=True)[0])


def test_a_malformed_key_is_refused_by_name(api, host, minilm):  # noqa: ANN001
    refused = api.post("/api/deployments/", BODY, format="json", HTTP_IDEMPOTENCY_KEY="x" * 300)
    assert refused.status_code == 400 and "Idempotency-Key" in refused.json()["errors"]
