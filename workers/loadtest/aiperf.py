"""AIPerf, the load generator: where it is, its version, and one step's
configuration (its v2 YAML schema; JSON is YAML). AIPerf lives in its own
virtual environment (``GANTRY_AIPERF``, made by scripts/ensure-aiperf.sh) so
its pins never meet Gantry's. The run's gateway key reaches it through the
environment, referenced from the configuration as ``${GANTRY_LOADTEST_KEY}``,
never on a command line.
"""

from __future__ import annotations

import json
import subprocess
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings

from deployments.models import ModelKind
from loadtests import workload as workloads
from loadtests.models import LoadTest
from workers import processes
from workers.jobs import JobFailed

KEY_ENV = "GANTRY_LOADTEST_KEY"
# Requests still open when a timed step ends get this long to finish.
GRACE_S = 30


def aiperf_executable() -> Path:
    return Path(settings.GANTRY_AIPERF)


def aiperf_version() -> str:
    """The installed AIPerf's version, or raise with how to install it."""
    executable = aiperf_executable()
    if not executable.exists():
        raise JobFailed(
            f"AIPerf is not installed on {settings.GANTRY_HOST_NAME} (GANTRY_AIPERF={executable}): "
            "run scripts/ensure-aiperf.sh there"
        )
    completed = subprocess.run(  # noqa: S603 - a fixed executable
        [str(executable), "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=processes.child_environment(),
    )
    return completed.stdout.strip().splitlines()[-1] if completed.returncode == 0 and completed.stdout else "unknown"


def command(config_path: Path) -> list[str]:
    """AIPerf's command line for one configuration file, without its own UI or telemetry."""
    return [str(aiperf_executable()), "profile", "--config", str(config_path), "--ui", "none",
            "--no-gpu-telemetry", "--no-server-metrics"]  # fmt: skip


def environment(key: str) -> dict[str, str]:
    """AIPerf's environment: the gateway key it sends, and the tokenizer's folder
    reachable (AIPerf's offline mode looks only in the hub cache and refuses a
    folder, so it must stay off)."""
    env = processes.child_environment({KEY_ENV: key, "HF_HUB_DISABLE_TELEMETRY": "1"})
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(name, None)
    return env


@dataclass(frozen=True)
class Step:
    target: str  # gateway | triton
    level: float
    index: int
    total: int


def config_for(
    run: LoadTest, step: Step, *, gateway_url: str, triton_url: str, tokenizer: str, artifacts: Path
) -> dict[str, Any]:
    """AIPerf's configuration for one step of ``run``."""
    w = run.workload
    llm = run.kind == ModelKind.LLM
    if step.target == "gateway":
        endpoint: dict[str, Any] = {
            "url": gateway_url,
            "type": {"llm": w["endpoint"], "embedding": "embeddings", "reranker": "cohere_rankings"}[run.kind],
            "apiKey": "${" + KEY_ENV + "}",
            "streaming": w["streaming"],
            # The gateway reports usage: count tokens as the server did (its chat template included).
            "useServerTokenCount": llm,
        }
        if run.kind == ModelKind.RERANKER:
            endpoint["path"] = "/v1/rerank"
        model = run.alias
    else:
        # Triton's own generate endpoint, the ensemble interface every LLM route serves.
        endpoint = {
            "url": triton_url,
            "type": "template",
            "path": f"/v2/models/{run.triton_name}/generate_stream",
            "streaming": True,  # it answers in server-sent events, one event when not streaming
            "template": {
                "body": '{"text_input": {{ text|tojson }}, "max_tokens": {{ max_tokens }}, '
                f'"stream": {json.dumps(w["streaming"])}}}',
                "responseField": "text_output",
            },
        }
        model = run.triton_name
    endpoint["timeout"] = float(workloads.STEP_LIMIT_S)
    phases: list[dict[str, Any]] = []
    if w["warmup_requests"]:
        phases.append({"name": "warmup", "type": "concurrency", "excludeFromResults": True,
                       "requests": w["warmup_requests"], "concurrency": 1})  # fmt: skip
    profiling: dict[str, Any] = {"name": "profiling"}
    if w["mode"] == "concurrency":
        profiling.update(type="concurrency", concurrency=int(step.level))
    else:
        profiling.update(type="poisson", rate=step.level)
    if w["duration_s"]:
        profiling.update(duration=w["duration_s"], gracePeriod=GRACE_S)
    else:
        profiling["requests"] = w["request_count"]
    phases.append(profiling)
    config: dict[str, Any] = {
        "schemaVersion": "2.0",
        "randomSeed": w["seed"],
        "benchmark": {
            "model": model,
            "endpoint": endpoint,
            "tokenizer": {"name": tokenizer},
            "dataset": _dataset(run),
            "phases": phases,
            "artifacts": {"dir": str(artifacts), "summary": ["json"], "records": ["jsonl"]},
        },
    }
    slos = {
        {"time_to_first_token_ms": "time_to_first_token", "inter_token_latency_ms": "inter_token_latency",
         "request_latency_ms": "request_latency"}[name]: value
        for name, value in w["thresholds"].items()
    }  # fmt: skip
    if slos:
        config["benchmark"]["slos"] = slos
    return config


def _dataset(run: LoadTest) -> dict[str, Any]:
    w = run.workload
    if w.get("dataset"):
        records = [{"text": text} for text in w["dataset"]]
        if run.kind == ModelKind.LLM:
            for record in records:
                record["output_length"] = w["output_tokens"]
        return {"type": "file", "format": "single_turn", "records": records}
    prompts: dict[str, Any] = {"isl": w["input_tokens"]}
    dataset: dict[str, Any] = {"type": "synthetic", "entries": 200, "prompts": prompts}
    if run.kind == ModelKind.LLM:
        prompts["osl"] = w["output_tokens"]
    elif run.kind == ModelKind.EMBEDDING:
        prompts["batchSize"] = w["batch_size"]
    else:
        dataset["rankings"] = {"passages": w["passages"], "passageTokens": w["input_tokens"], "queryTokens": 16}
    return dataset


def last_error(tail: deque[str]) -> str:
    """AIPerf's first stated reason (its exit box wraps it over several lines)."""
    lines = [line.strip("│ ╭╰─\t") for line in tail]
    for i, line in enumerate(lines):
        if line.startswith("Reason:"):
            reason = [line.removeprefix("Reason:").strip()]
            for more in lines[i + 1 :]:
                if not more or more.split(":", 1)[0] in ("Cause", "Service", "Operation", "Error") or more[0] == "•":
                    break
                reason.append(more)
            return " ".join(reason)[:400]
    errors = [line for line in lines if "ERROR" in line or "Error" in line]
    return errors[-1][:400] if errors else ""
