"""A model from the hub on two hosts for real: registered by hub id through the
API, downloaded by the first host's worker, then fetched by the second host
for a replica placed there (the replica waits, fetching), with that host's
worker killed mid-download and started again: the download resumes from its
partial file, and both replicas serve. The hub is the only stand-in
(tests/hubserver.py, answering each host at its end of the veth pair); the
download is huggingface_hub's own, the workers, Triton and the browser real."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest
import requests

from common import pki
from tests.hubserver import HubServer, Repo
from tests.integration.conftest import fleet, forwarded, free_port, wait_for

pytestmark = [pytest.mark.integration]
HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"


def test_a_hub_model_reaches_a_second_host_that_fetches_it_through_its_workers_death(
    tmp_path: Path,
    minilm_path: Path,
    page,
    screenshot,  # noqa: ANN001
):
    port = free_port()
    files = {str(p.relative_to(minilm_path)): p.read_bytes() for p in minilm_path.rglob("*") if p.is_file()}
    repos = {HUB_ID: Repo(files)}
    with (
        fleet(tmp_path, 2, {"GANTRY_HUB_ENDPOINT": f"http://127.0.0.1:{port}"}) as plane,
        contextlib.ExitStack() as hubs,
    ):
        served = {name: hubs.enter_context(HubServer(repos, port=port, address=ns.gateway))
                  for name, ns in plane.hosts.items()}  # fmt: skip
        http, base = plane.session(), plane.base
        body = {"name": "minilm", "kind": "embedding", "host": "host-a", "hub_id": HUB_ID,
                "ignore_patterns": ["README.md"]}  # fmt: skip
        created = http.post(f"{base}/api/models/", json=body, timeout=30)
        assert created.status_code == 201, created.text
        model_path = f"/api/models/{created.json()['id']}/"
        wait_for(lambda: plane.get(model_path)["inspection"] == "ready", 120, "the first download and inspection")
        model = plane.get(model_path)
        [first] = model["downloads"]
        assert first["host"] == "host-a" and first["status"] == "succeeded", first
        assert first["bytes_total"] == sum(len(v) for k, v in files.items() if k != "README.md")
        assert model["commit"] == repos[HUB_ID].commit and model["architecture"] == "BertModel"

        # Two replicas, spread: the second goes to host-b, which lacks the files.
        served["host-b"].rate_bps = 4 * 1024 * 1024  # slow enough to be caught mid-way
        body = {"name": "both", "replicas": 2, "models": [{"model": "minilm"}]}
        deployment = http.post(f"{base}/api/deployments/", json=body, timeout=30).json()
        path = f"/api/deployments/{deployment['id']}/"
        assert http.post(f"{base}{path}start/", timeout=30).status_code == 202

        def fetching() -> dict:
            rows = [d for d in plane.get(model_path)["downloads"] if d["host"] == "host-b"]
            return rows[0] if rows else {}

        wait_for(lambda: fetching().get("bytes_done", 0) > 20 * 1024 * 1024, 120, "host-b's download under way")
        replica_b = next(r for r in plane.get(path)["replica_set"] if r["host"] == "host-b")
        assert replica_b["status"] == "fetching", replica_b
        os.killpg(plane.workers["host-b"].pid, signal.SIGKILL)  # host-b loses its worker mid-download
        plane.start_worker("host-b")

        def taken_over() -> bool:
            said = plane.get(f"/api/events/?model={model['id']}&kind=model.download&limit=100")["results"]
            return any("resumed by a new worker" in e["message"] for e in said)

        # The new worker stops what its predecessor's download left running, and goes on from its files.
        wait_for(taken_over, 120, "host-b's new worker taking the download over")
        served["host-b"].rate_bps = 0
        wait_for(lambda: fetching().get("status") == "succeeded", 180, "host-b's download, resumed")
        assert served["host-b"].ranged(), "host-b's new worker fetched the partial file again from the start"
        wait_for(lambda: plane.get(path)["status"] == "ready", 300, "both replicas ready")
        assert {r["host"]: r["status"] for r in plane.get(path)["replica_set"]} == {
            "host-a": "ready",
            "host-b": "ready",
        }
        timeline = plane.get(f"{path}events/?limit=200")["results"]
        moves = [(e["from_status"], e["to_status"]) for e in timeline if e["kind"] == "replica.status"]
        assert ("launching", "fetching") in moves and ("fetching", "launching") in moves, moves
        copies = {c["host"]: c["matches"] for c in plane.get(model_path)["copies"]}
        assert copies == {"host-a": True, "host-b": True}

        embedded = http.post(f"{base}{path}embed/", json={"texts": ["from the hub"], "model": "minilm"}, timeout=30)
        assert embedded.status_code == 200 and len(embedded.json()["embeddings"][0]) == 384, embedded.text

        # The model's page: its hub, both downloads, and what each host's cache holds.
        page.goto(f"{base}/models/{created.json()['id']}/")
        page.fill("input[name=username]", "ops")
        page.fill("input[name=password]", "ops-pass")
        page.click("button[type=submit]")
        assert HUB_ID in page.inner_text("#hub")
        assert page.locator("#downloads tr[data-download]").count() == 2
        assert page.locator("#cached tr[data-host]").count() == 2
        screenshot("model-from-the-hub")


def test_a_host_without_the_hub_fetches_through_the_control_plane_from_a_host_that_holds_it(
    tmp_path: Path, minilm_path: Path
):
    """host-b reaches neither the hub nor a mirror: the hub stand-in answers only
    host-a. With GANTRY_HUB_VIA_CONTROL_PLANE its download goes to the control
    plane's /hub/ relay, which fetches from host-a's cache over host-a's channel.
    A host's own key cannot open another host's download there."""
    port, web_for_b = free_port(), free_port()
    files = {str(p.relative_to(minilm_path)): p.read_bytes() for p in minilm_path.rglob("*") if p.is_file()}
    repos = {HUB_ID: Repo(files)}
    # host-b reaches the web tier at its end of its veth pair, a name the web answers to only here.
    env = {"GANTRY_HUB_ENDPOINT": f"http://127.0.0.1:{port}", "ALLOWED_HOSTS": "*"}
    b_env = {"GANTRY_HUB_VIA_CONTROL_PLANE": "1", "GANTRY_GATEWAY_URL": f"http://127.0.0.1:{web_for_b}"}
    with fleet(tmp_path, 2, env, per_host={"host-b": b_env}) as plane, contextlib.ExitStack() as stack:
        hub_a = stack.enter_context(HubServer(repos, port=port, address=plane.hosts["host-a"].gateway))
        web_port = int(plane.base.rsplit(":", 1)[1])
        stack.enter_context(forwarded((plane.hosts["host-b"].gateway, web_for_b), ("127.0.0.1", web_port)))
        http, base = plane.session(), plane.base
        body = {"name": "minilm", "kind": "embedding", "host": "host-a", "hub_id": HUB_ID}
        model_id = http.post(f"{base}/api/models/", json=body, timeout=30).json()["id"]
        model_path = f"/api/models/{model_id}/"
        wait_for(lambda: plane.get(model_path)["inspection"] == "ready", 120, "host-a's download and inspection")
        wait_for(lambda: plane.get("/api/hosts/?limit=10")["results"][0]["channel_port"], 60, "the channels")
        asked_of_the_hub = len(hub_a.requests)

        # An attacker with host-a's own channel key tries host-b's download: refused.
        asked = http.post(f"{base}{model_path}downloads/", json={"host": "host-b"}, timeout=30)
        assert asked.status_code == 202, asked.text
        download_id = asked.json()["id"]
        key_a = pki.load_key((tmp_path / "host-a" / "channel" / "key.pem").read_text())
        forged = f"{download_id}.{pki.prove(key_a, f'gantry-hub-relay:{download_id}')}"
        tree = f"{base}/hub/api/models/{HUB_ID}/tree/{repos[HUB_ID].commit}"
        for token in (forged, f"{download_id}.00", ""):
            refused = requests.get(tree, headers={"Authorization": f"Bearer {token}"}, timeout=30)
            assert refused.status_code == 403, (token, refused.status_code, refused.text)
        assert (
            "not signed by host-b's channel key"
            in requests.get(tree, headers={"Authorization": f"Bearer {forged}"}, timeout=30).text
        )

        def row() -> dict:
            return next(d for d in plane.get(model_path)["downloads"] if d["id"] == download_id)

        wait_for(lambda: row()["status"] in ("succeeded", "failed"), 180, "host-b's download through the relay")
        assert row()["status"] == "succeeded", row()
        assert len(hub_a.requests) == asked_of_the_hub  # host-b never asked the hub
        copies = {c["host"]: c["matches"] for c in plane.get(model_path)["copies"]}
        assert copies == {"host-a": True, "host-b": True}
        # Once done, its token opens nothing.
        key_b = pki.load_key((tmp_path / "host-b" / "channel" / "key.pem").read_text())
        spent = f"{download_id}.{pki.prove(key_b, f'gantry-hub-relay:{download_id}')}"
        assert requests.get(tree, headers={"Authorization": f"Bearer {spent}"}, timeout=30).status_code == 403
