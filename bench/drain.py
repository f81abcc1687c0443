"""Benchmark: a scale-down under live streams, drained against stopped at once.

The control plane runs as a user runs it (tests/gpu/control_plane.py: the
demo's processes on SQLite, through the REST API and the gateway only). An
LLM checkpoint made on the machine (workers/untrained.py, UNTRAINED weights:
its text means nothing, its cost is real; a ~1.1B Llama in 16 bits on a GPU,
the tiny one on a CPU with GANTRY_GPU_SUITE_REHEARSAL=1) serves one alias from
two replicas. Each round starts --streams streamed chat completions of
--tokens tokens through /v1, waits until every one has its first token, and
scales 2 -> 1; then back to 2 for the next round. The rounds alternate
between the deployment's drain timeout at --drain-s (Gantry's draining) and
at 0 (the floor: the server stopped at once, as before draining, with only
Triton's own 5 s exit timeout). It prints, per side:

- streams cut (an error event, or no finish_reason or [DONE]); target 0 when
  drained;
- seconds from the scale-down request to the retired replica gone (removed),
  beside the drain timeout, and to the last stream's end.

    make bench-drain BENCH_DRAIN_ARGS="--rounds 4 --out report.json"
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REHEARSAL = os.environ.get("GANTRY_GPU_SUITE_REHEARSAL") == "1"


def _stream(url: str, key: str, body: dict, out: dict, begun: threading.Semaphore) -> None:
    from tests.sse import chat_stream

    end = chat_stream(url, key, body, begun=begun)
    out.update(cut=end.cut, error=end.error, ended=end.ended)


def _round(plane, deployment_id: int, key: str, args: argparse.Namespace, drain_s: int) -> dict:  # noqa: ANN001
    from tests.gpu.control_plane import wait_for

    path = f"/api/deployments/{deployment_id}/"
    plane.ok("PATCH", path, 202, json={"drain_timeout_s": drain_s})
    if plane.ok("GET", path)["replicas"] != 2:
        plane.ok("POST", f"{path}scale/", 202, json={"replicas": 2})
    wait_for(
        lambda: sum(r["status"] == "ready" for r in plane.ok("GET", path)["replica_set"]) == 2, 600, "two replicas"
    )
    body = {
        "model": "drained", "messages": [{"role": "user", "content": "Write about GPUs, models and serving."}],
        "max_tokens": args.tokens, "temperature": 1.0,
    }  # fmt: skip
    results: list[dict] = [{} for _ in range(args.streams)]
    begun = threading.Semaphore(0)
    threads = [
        threading.Thread(target=_stream, args=(f"{plane.url}/v1/chat/completions", key, body, out, begun))
        for out in results
    ]
    for thread in threads:
        thread.start()
    for _ in threads:
        begun.acquire(timeout=300)
    asked = time.monotonic()
    scaled = plane.ok("POST", f"{path}scale/", 202, json={"replicas": 1})
    retired = next(r["serial"] for r in scaled["replica_set"] if r["desired_state"] == "stopped")
    wait_for(
        lambda: retired not in {r["serial"] for r in plane.ok("GET", path)["replica_set"]},
        drain_s + 120,
        "the retired replica gone",
        interval_s=0.2,
    )
    gone = time.monotonic() - asked
    for thread in threads:
        thread.join(timeout=900)
    return {
        "drain_s": drain_s,
        "streams": args.streams,
        "cut": sum(1 for r in results if r.get("cut", True)),
        "gone_s": round(gone, 1),
        "last_stream_end_s": round(max(r.get("ended", asked) for r in results) - asked, 1),
        "errors": sorted({r["error"] for r in results if r.get("error")})[:3],
    }


def main() -> int:
    from tests.gpu import control_plane
    from tests.gpu.control_plane import TOKENIZER
    from workers.untrained import make_untrained_llm

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/gantry-drain-bench"))
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128 if REHEARSAL else 1024)
    parser.add_argument("--drain-s", type=int, default=120, help="the drained side's drain timeout")
    parser.add_argument("--rounds", type=int, default=4, help="rounds in all, the two sides alternating")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    size = "tiny" if REHEARSAL else "1b"
    checkpoint = make_untrained_llm(args.work / "models" / f"llm-{size}", size=size, tokenizer_dir=TOKENIZER)
    plane = control_plane.start(args.work / "control-plane", model_roots=[args.work / "models"])
    try:
        model = plane.register("llm", "llm", checkpoint)
        assert model["inspection"] == "ready", model["inspection_message"]
        # Two replicas on one GPU (0.4 each), or on this host's CPU in a rehearsal.
        where = {} if REHEARSAL else {"instance_kind": "KIND_GPU", "gpu_ids": [0], "gpu_memory_fraction": 0.4}
        placement = {
            "model": "llm",
            "max_batch_size": 8 if REHEARSAL else 64,
            "max_seq_len": 512 if REHEARSAL else 2048,
            **where,
        }
        body = {"name": "drained", "host": plane.host, "replicas": 2, "models": [placement]}
        deployment = plane.ok("POST", "/api/deployments/", 201, json=body)
        plane.ok("POST", f"/api/deployments/{deployment['id']}/start/", 202)
        ready = plane.wait_status(deployment["id"], {"ready", "failed"})
        assert ready["status"] == "ready", ready["status_message"]
        alias = {"name": "drained", "deployment": deployment["id"], "model": "llm"}
        plane.ok("POST", "/api/gateway/aliases/", 201, json=alias)
        key = plane.ok("POST", "/api/gateway/keys/", 201, json={"name": "bench", "all_aliases": True})["key"]
        rounds = []
        for n in range(args.rounds):
            sides = (args.drain_s, 0) if n % 2 == 0 else (0, args.drain_s)
            rounds.append(_round(plane, deployment["id"], key, args, sides[0]))
            print(json.dumps(rounds[-1]), flush=True)
    finally:
        plane.stop()
    report = {"rehearsal": REHEARSAL, "streams": args.streams, "tokens": args.tokens, "rounds": rounds}
    _print(report, args.drain_s)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


def _print(report: dict, drain_s: int) -> None:
    print(f"\nscale-down 2 -> 1 under {report['streams']} streams of {report['tokens']} tokens"
          f"{' (rehearsal: tiny LLM on the CPU)' if report['rehearsal'] else ''}")  # fmt: skip
    print(f"{'side':<26} {'rounds':>6} {'cut (each round)':>18} {'gone after (s)':>16} {'last stream end (s)':>20}")
    for label, side in ((f"drained (timeout {drain_s} s)", drain_s), ("floor: stopped at once", 0)):
        rows = [r for r in report["rounds"] if r["drain_s"] == side]
        if not rows:
            continue
        cut = "/".join(str(r["cut"]) for r in rows)
        gone = "/".join(str(r["gone_s"]) for r in rows)
        ended = "/".join(str(r["last_stream_end_s"]) for r in rows)
        print(f"{label:<26} {len(rows):>6} {cut:>18} {gone:>16} {ended:>20}")
    print("target: 0 cut when drained; gone within the drain timeout (and the server's stop) of the request")


if __name__ == "__main__":
    sys.exit(main())
