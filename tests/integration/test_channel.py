"""Triton answers only Gantry, across hosts, for real: two GPU hosts in
network namespaces of their own. From another address (this machine's end of
host B's link), every port of host B's Triton refuses (it binds loopback), and
B's channel refuses a connection without the web tier's certificate, or with
host A's. The gateway on this
machine still streams a chat from the LLM on host B, through B's channel.
Revoking host B cuts it off: the gateway no longer reaches it, and the
revocation list makes the TLS handshake itself fail."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.integration.conftest import fleet, manage, wait_for

pytestmark = [pytest.mark.integration]

# Each attempt's outcome, by name.
_PROBE = r"""
import json, socket, ssl, sys
from pathlib import Path
address, ports, channel_port = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
server_name, own = sys.argv[4], Path(sys.argv[5])
out = {}
for name, port in ports.items():
    try:
        socket.create_connection((address, port), timeout=3).close()
        out[name] = "open"
    except OSError as exc:
        out[name] = type(exc).__name__
def tls(context):
    try:
        with socket.create_connection((address, channel_port), timeout=5) as raw:
            with context.wrap_socket(raw, server_hostname=server_name) as conn:
                conn.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                answer = conn.recv(100)
                return "answered" if answer else "closed"
    except (OSError, ssl.SSLError) as exc:
        return type(exc).__name__
bare = ssl.create_default_context(cafile=str(own / "trust.pem")); bare.check_hostname = False
out["channel, no certificate"] = tls(bare)
as_host = ssl.create_default_context(cafile=str(own / "trust.pem")); as_host.check_hostname = False
as_host.load_cert_chain(str(own / "cert.pem"), str(own / "key.pem"))
out["channel, a host's certificate"] = tls(as_host)
print(json.dumps(out))
"""

# Run on the control plane: the web tier's own context against B's channel.
_HANDSHAKE = """
import socket, ssl
from hosts.services.channel import client_context
try:
    with socket.create_connection(("{address}", {port}), timeout=5) as raw:
        client_context().wrap_socket(raw, server_hostname="{name}").close()
    print("handshake: accepted")
except ssl.SSLCertVerificationError as exc:
    print("handshake:", exc.verify_message)
"""


def test_only_the_web_tier_reaches_a_hosts_triton_and_revoking_the_host_cuts_it_off(tmp_path: Path, tiny_llm: Path):
    with fleet(tmp_path, 2) as plane:
        http, base, get = plane.session(), plane.base, plane.get
        b = plane.hosts["host-b"]

        def host_row(name: str) -> dict:
            return next(h for h in get("/api/hosts/")["results"] if h["name"] == name)

        body = {"name": "tiny", "kind": "llm", "path": str(tiny_llm), "host": "host-b"}
        assert http.post(f"{base}/api/models/", json=body, timeout=30).status_code == 201
        wait_for(lambda: get("/api/models/?name=tiny")["results"][0]["inspection"] == "ready", 120, "inspection")
        body = {"name": "far", "host": "host-b", "models": [{"model": "tiny", "max_batch_size": 4}]}
        created = http.post(f"{base}/api/deployments/", json=body, timeout=30).json()
        assert http.post(f"{base}/api/deployments/{created['id']}/start/", timeout=30).status_code == 202
        path = f"/api/deployments/{created['id']}/"
        wait_for(lambda: get(path)["shown_status"] == "ready", 300, "the LLM on host B")
        [replica] = get(path)["replica_set"]
        assert replica["host"] == "host-b"
        certified = [e["message"] for e in get("/api/events/?host=host-b&kind=host.certificate&limit=10")["results"]]
        assert certified and "its first" in certified[-1], certified

        # From another address: Triton's three ports on B refuse; B's channel refuses strangers.
        ports = {"HTTP": replica["http_port"], "gRPC": replica["grpc_port"], "metrics": replica["metrics_port"]}
        channel_port = host_row("host-b")["channel_port"]
        host_b_id = manage(
            plane.control_env,
            "shell",
            "-c",
            "from hosts.models import GpuHost as H; print(H.objects.get(name='host-b').pk)",
        )
        server_name = f"p{replica['http_port']}.h{host_b_id.split()[-1]}.gantry"
        probe = subprocess.run(
            [sys.executable, "-c", _PROBE, b.address,
             json.dumps(ports), str(channel_port), server_name, str(tmp_path / "host-a" / "channel")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert probe.returncode == 0, probe.stderr
        outcomes = json.loads(probe.stdout)
        assert {outcomes[n] for n in ports} == {"ConnectionRefusedError"}, outcomes
        assert outcomes["channel, no certificate"] != "answered", outcomes
        assert outcomes["channel, a host's certificate"] != "answered", outcomes

        # The gateway on this machine streams from the LLM on host B, through B's channel.
        alias = {"name": "far-chat", "deployment": created["id"], "model": "tiny"}
        assert http.post(f"{base}/api/gateway/aliases/", json=alias, timeout=30).status_code == 201
        key = http.post(f"{base}/api/gateway/keys/", json={"name": "k", "all_aliases": True}, timeout=30).json()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key["key"], max_retries=0, timeout=60)
        chunks = list(client.chat.completions.create(
            model="far-chat", messages=[{"role": "user", "content": "hello"}], max_tokens=8, seed=1, stream=True,
        ))  # fmt: skip
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        handshake = _HANDSHAKE.format(address=b.address, port=channel_port, name=server_name)
        assert "handshake: accepted" in manage(plane.control_env, "shell", "-c", handshake)

        # Revoking host B cuts it off.
        assert http.post(f"{base}/api/hosts/host-b/revoke/", timeout=30).json()["revoked"] >= 1
        assert "certificate revoked" in manage(plane.control_env, "shell", "-c", handshake)

        def refused() -> bool:
            try:
                client.chat.completions.create(model="far-chat", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4)  # fmt: skip
            except openai.APIStatusError as exc:
                return exc.status_code == 503
            return False

        wait_for(refused, 30, "the gateway to stop reaching host B")
        assert host_row("host-b")["channel_port"] == 0
        kinds = [e["kind"] for e in get("/api/events/?host=host-b&limit=50")["results"]]
        assert "host.revoked" in kinds, kinds
