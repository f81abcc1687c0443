"""A tuning run of the seeds' stack on one GPU, through Gantry itself (issue 35).

The control plane runs as a user runs it (tests/gpu/control_plane.py), and the
seeds' stack is deployed at the seeds' hand-picked split as bench/gpu_stack.py
deploys it (an untrained ~1.1B Llama, a reranker and an embedder: their text
means nothing, their cost is real). A tuning run then searches that
deployment under a mix like seed 002's, every alias at once (streamed chat,
embeddings of 16 sentences, reranks of 8 passages), against per-model p99
targets, over the knobs seed 002 turns by hand: the embedder's and
reranker's batch sizes and instance counts, and the LLM's concurrent
sequences and share of the GPU. Trial 0 is the seeds' split, measured in the same run.

It prints:
- goodput (requests/s meeting every target, all aliases) of the seeds' split
  and of the best plan, and their ratio;
- the search's wall time per trial (its generation rolled out, the load
  generators started, the load, their results read) against one plain load
  test of the same length (AIPerf started, the same seconds of load, its
  results read), as p50 and max over the trials and their ratio.

    make bench-tuning BENCH_TUNING_ARGS="--trial-s 20 --max-trials 8 --out report.json"

GANTRY_GPU_SUITE_REHEARSAL=1 runs the same on a CPU host with the tiny LLM
and rates scaled down (bench/gpu_stack.py's rehearsal).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_stack import REHEARSAL, deploy  # noqa: E402

# Requests per second per alias, and each model's p99 targets (ms).
MIX = {
    "seed-llm": {"rate": 0.5 if REHEARSAL else 8.0, "input_tokens": 128, "output_tokens": 16 if REHEARSAL else 128,
                 "targets": {"time_to_first_token_ms": 3000.0 if REHEARSAL else 300.0,
                             "inter_token_latency_ms": 500.0 if REHEARSAL else 30.0}},
    "seed-embedder": {"rate": 2.0 if REHEARSAL else 200.0, "batch_size": 16,
                      "targets": {"request_latency_ms": 2000.0 if REHEARSAL else 50.0}},
    "seed-reranker": {"rate": 1.0 if REHEARSAL else 50.0, "passages": 8,
                      "targets": {"request_latency_ms": 2000.0 if REHEARSAL else 100.0}},
}  # fmt: skip
# The knobs seed 002 turns by hand, around the seeds' split.
SPACE = {
    "embedder": {"max_batch_size": [128, 256], "instance_count": [1, 2]},
    "reranker": {"max_batch_size": [64, 128], "instance_count": [1, 2]},
    # Room for a second instance comes out of the LLM's share (the plan prunes what does not fit).
    "llm": {"max_num_sequences": [32, 64], "gpu_memory_fraction": [0.8, 0.7]},
}


def _seconds(row: dict) -> float:
    began, ended = (dt.datetime.fromisoformat(row[name]) for name in ("started_at", "finished_at"))
    return (ended - began).total_seconds()


def main() -> int:
    from tests.gpu import control_plane
    from tests.gpu.control_plane import TOKENIZER
    from workers.untrained import make_untrained_encoder, make_untrained_llm

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/gantry-tuning-bench"))
    parser.add_argument("--trial-s", type=int, default=20)
    parser.add_argument("--max-trials", type=int, default=8)
    parser.add_argument("--budget-s", type=int, default=3600)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    models = args.work / "models"
    size = "tiny" if REHEARSAL else "1b"
    checkpoints = {
        "llm": make_untrained_llm(models / f"llm-{size}", size=size, tokenizer_dir=TOKENIZER),
        "reranker": make_untrained_encoder(models / "reranker", kind="reranker", tokenizer_dir=TOKENIZER),
        "embedder": make_untrained_encoder(
            models / "embedder", kind="embedding", remote_code=True, tokenizer_dir=TOKENIZER
        ),
    }
    plane = control_plane.start(args.work / "control-plane", model_roots=[models])
    try:
        deployment_id, _ = deploy(plane, checkpoints)
        spec = {
            "deployment": deployment_id,
            "mix": [{"model": alias, **entry} for alias, entry in MIX.items()],
            "space": SPACE,
            "trial_s": args.trial_s,
            "budget_s": args.budget_s,
            "max_trials": args.max_trials,
            "confirm": True,
        }
        began = time.monotonic()
        run = plane.ok("POST", "/api/tuning/", 201, json=spec)
        while run["status"] not in ("succeeded", "failed", "cancelled"):
            time.sleep(5)
            run = plane.ok("GET", f"/api/tuning/{run['id']}/")
        search_s = time.monotonic() - began
        assert run["status"] == "succeeded", run["status_message"]
        # One plain load test of the same length, of the embedder at its rate, on the settings the run put back.
        ready = plane.wait_status(deployment_id, {"ready"})
        workload = {"mode": "rate", "levels": [MIX["seed-embedder"]["rate"]], "duration_s": args.trial_s,
                    "batch_size": 16}  # fmt: skip
        test = plane.ok("POST", "/api/loadtests/", 201, json={"deployment": ready["id"], "model": "seed-embedder",
                                                              "workload": workload, "confirm": True})  # fmt: skip
        while test["status"] not in ("succeeded", "failed", "cancelled"):
            time.sleep(2)
            test = plane.ok("GET", f"/api/loadtests/{test['id']}/")
        assert test["status"] == "succeeded", test["status_message"]
    finally:
        plane.stop()
    trials = {t["number"]: t for t in run["trials"]}
    measured = [t for t in run["trials"] if t["status"] == "measured"]
    walls = [_seconds(t) for t in measured]
    best = trials[run["result"]["best"]]
    report = {
        "trials": run["trials"],
        "search_s": round(search_s, 1),
        "seeds_split_goodput": trials[0]["goodput"],
        "best_goodput": best["goodput"],
        "best_trial": best["number"],
        "best_changes": run["result"]["changes"],
        "gain": run["result"]["gain"],
        "trial_wall_s": {"p50": round(statistics.median(walls), 1), "max": round(max(walls), 1)},
        "plain_load_test_wall_s": round(_seconds(test), 1),
    }
    report["trial_over_load_test"] = round(report["trial_wall_s"]["p50"] / report["plain_load_test_wall_s"], 2)
    print(f"\ntuning: {len(run['trials'])} trials ({len(measured)} measured) in {report['search_s']} s; "
          f"{run['status_message']}")  # fmt: skip
    print(f"{'trial':>5} {'status':>8} {'goodput':>8} {'GPU share':>9}  settings")
    for trial in run["trials"]:
        goodput = "–" if trial["goodput"] is None else f"{trial['goodput']:.2f}"
        print(f"{trial['number']:>5} {trial['status']:>8} {goodput:>8} {trial['gpu_share']:9.3f}  "
              f"{trial['params']}{' ' + trial['reason'][:80] if trial['reason'] else ''}")  # fmt: skip
    print(
        f"goodput: seeds' split {report['seeds_split_goodput']} req/s, best (trial {best['number']}) "
        f"{report['best_goodput']} req/s: {report['gain']}x"
    )
    print(
        f"wall per trial p50 {report['trial_wall_s']['p50']} s (max {report['trial_wall_s']['max']}), one plain "
        f"load test of {args.trial_s} s: {report['plain_load_test_wall_s']} s: {report['trial_over_load_test']}x"
    )
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
