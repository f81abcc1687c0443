"""One error shape under /api/: status, code, detail and field errors, JSON
even where no view answers."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient


def test_an_unknown_api_path_is_a_json_404(api):  # noqa: ANN001
    response = api.get("/api/no-such-thing/")
    assert response.status_code == 404 and response["Content-Type"] == "application/json"
    assert response.json() == {
        "status": 404,
        "code": "not_found",
        "detail": "nothing at /api/no-such-thing/",
        "errors": {},
    }


def test_a_missing_object_and_a_wrong_method_answer_in_the_same_shape(api):  # noqa: ANN001
    missing = api.get("/api/deployments/999999/").json()
    assert (missing["status"], missing["code"]) == (404, "not_found")
    wrong = api.delete("/api/hosts/").json()
    assert (wrong["status"], wrong["code"]) == (405, "method_not_allowed")


def test_nested_field_errors_are_flat_paths(api, host, minilm):  # noqa: ANN001
    response = api.post(
        "/api/deployments/",
        {"name": "d", "host": "cpu-host", "models": [{"model": "minilm", "gpu_ids": [0, -1]}]},
        format="json",
    )
    assert response.status_code == 400
    assert list(response.data["errors"]) == ["models[0].gpu_ids[1]"]
    assert response.data["detail"].startswith("models[0].gpu_ids[1]: ")


def test_a_page_outside_the_api_is_not_found_in_gantrys_layout(client, operator):  # noqa: ANN001
    client.force_login(operator)
    response = client.get("/no-such-page/")
    assert response.status_code == 404 and b"Back to the dashboard" in response.content


def test_a_body_that_is_not_json_is_refused_in_the_same_shape():
    response = APIClient().post("/api/models/", "{", content_type="application/json")
    assert response.json()["status"] == response.status_code


def test_json_types_are_not_coerced(api, host, minilm):  # noqa: ANN001
    response = api.post(
        "/api/deployments/",
        {"name": 12, "host": "cpu-host", "models": [{"model": "minilm", "max_batch_size": "8", "gpu_ids": [True]}]},
        format="json",
    )
    assert response.status_code == 400
    assert response.data["errors"] == {
        "name": ["must be a string"],
        "models[0].max_batch_size": ["must be an integer"],
        "models[0].gpu_ids[0]": ["must be an integer"],
    }


BIG = 2**64


@pytest.mark.parametrize(
    "path",
    [
        f"/api/gateway/aliases/?deployment={BIG}",
        f"/api/events/?deployment={BIG}",
        f"/api/events/?build={BIG}",
        f"/api/gateway/usage/?key={BIG}",
        f"/api/loadtests/?deployment={BIG}",
    ],
)
def test_an_id_beyond_the_databases_64_bits_is_a_400_naming_the_field(api, path: str) -> None:  # noqa: ANN001
    response = api.get(path)
    assert response.status_code == 400, response.content
    [(field, [rule])] = response.json()["errors"].items()
    assert field == path.split("?")[1].split("=")[0]
    assert rule == f"Ensure this value is less than or equal to {2**63 - 1}."


def test_an_id_beyond_64_bits_in_a_body_is_a_400_naming_the_field(api, host, minilm) -> None:  # noqa: ANN001
    body = {"name": "d", "host": "cpu-host", "models": [{"model": "minilm", "engine_build": BIG}]}
    response = api.post("/api/deployments/", body, format="json")
    assert response.status_code == 400
    assert list(response.json()["errors"]) == ["models[0].engine_build"]


def test_the_timeline_page_refuses_an_id_beyond_64_bits(client, operator) -> None:  # noqa: ANN001
    client.force_login(operator)
    response = client.get(f"/events/?deployment={BIG}")
    assert response.status_code in (200, 400) and b"less than or equal to" in response.content


def test_a_strings_length_is_checked_as_sent_not_after_trimming(api) -> None:  # noqa: ANN001
    """The schema says maxLength 255: 256 characters are refused even when one is a
    leading NEL that DRF would have trimmed first (found by the contract fuzzer)."""
    body = {"model": "m", "host": "h", "image": "\u0085" + "*" * 255}
    response = api.post("/api/builds/preflight/", body, format="json")
    assert response.status_code == 400
    assert response.json()["errors"] == {"image": ["Ensure this field has no more than 255 characters."]}
