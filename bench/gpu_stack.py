"""The seeds' stack on one GPU, measured: an LLM, a reranker and an embedder in
one tritonserver at the seeds' split of GPU 0 (LLM 0.80, reranker 0.10,
embedder 0.05), written by Gantry's own config and repository code and run by
its process runtime (the nvidia-pytriton tritonserver).

The LLM is a Llama of about 1.1B parameters in fp16 made on the machine
(workers/untrained_llm.py, size "1b": a real architecture and tokenizer,
UNTRAINED weights), served by the transformers path. The embedder and the
cross-encoder reranker are MiniLM-shaped BERTs with random weights.

It prints, as JSON and as a table:
- streamed generation at 1, 8 and 32 concurrent streams while embed and rerank
  requests run beside it: time to first token p50/p99, tokens/s per stream and
  in all, and the batching gain over one stream;
- embed and rerank latency and rate alone and beside the LLM load;
- each server process's peak GPU memory (NVML) against its fraction's budget;
- the cap check, which fails if the cap is removed from the model code: the
  LLM given 0.02 of the GPU (less than its weights) must fail to load with
  PyTorch's out-of-memory error, though the GPU has room to spare.

    python bench/gpu_stack.py --tokenizer DIR [--out report.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FRACTIONS = {"llm": 0.80, "reranker": 0.10, "embedder": 0.05}
SENTENCES = [f"Sentence number {i} about GPUs, models and serving." for i in range(16)]


def make_checkpoints(work: Path, tokenizer_dir: Path) -> dict[str, Path]:
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, BertModel

    from workers.untrained_llm import make_untrained_llm

    llm = make_untrained_llm(work / "llm-1b", size="1b", tokenizer_dir=tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    shape = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
    made = {"llm": llm}
    for name, cls, extra in (
        ("embedder", BertModel, {}),
        ("reranker", BertForSequenceClassification, {"num_labels": 1}),
    ):
        folder = work / name
        if not (folder / "config.json").exists():
            torch.manual_seed(1)
            cls(BertConfig(vocab_size=len(tokenizer), **shape, **extra)).save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        made[name] = folder
    return made


def specs(checkpoints: dict[str, Path], fractions: dict[str, float], only: list[str] | None = None) -> list:
    from workers.triton.config import EMBED, RERANK, Batching, CausalLmSpec, Instances, PythonModelSpec

    gpu = Instances(count=1, kind="KIND_GPU", gpus=(0,))
    made = {
        "llm": CausalLmSpec(
            name="llm", checkpoint_path=str(checkpoints["llm"]), gpu_memory_fraction=fractions["llm"],
            batching=Batching(max_batch_size=32, max_queue_delay_us=1000), instances=gpu,
        ),
        "embedder": PythonModelSpec(
            name="embedder", task=EMBED, checkpoint_path=str(checkpoints["embedder"]), embedding_dim=384,
            batching=Batching(max_batch_size=64, max_queue_delay_us=1000), instances=gpu,
            gpu_memory_fraction=fractions["embedder"],
        ),
        "reranker": PythonModelSpec(
            name="reranker", task=RERANK, checkpoint_path=str(checkpoints["reranker"]), embedding_dim=384,
            batching=Batching(max_batch_size=16, max_queue_delay_us=1000), instances=gpu,
            gpu_memory_fraction=fractions["reranker"],
        ),
    }  # fmt: skip
    return [made[name] for name in (only or made)]


class Server:
    def __init__(self, work: Path, model_specs: list, port: int) -> None:
        from workers.runtimes.base import LaunchSpec
        from workers.runtimes.process import ProcessRuntime
        from workers.triton.repository import write_repository

        folder = work / "deployment"
        self.spec = LaunchSpec(
            deployment_id=0, generation=1, repository=folder / "repository", models=[s.name for s in model_specs],
            http_port=port, grpc_port=port + 1, metrics_port=port + 2, log_path=folder / "tritonserver.log",
        )  # fmt: skip
        write_repository(self.spec.repository, model_specs)
        self.runtime = ProcessRuntime(work / "data")
        self.handle = self.runtime.start(self.spec)
        self.url = f"127.0.0.1:{port}"

    def wait_ready(self, timeout_s: float = 600) -> bool:
        from deployments.errors import GantryError
        from workers.triton.client import TritonClient

        client = TritonClient(self.url)
        try:
            client.wait_until_ready(
                self.spec.models,
                timeout_s=timeout_s,
                keep_waiting=lambda: self.runtime.is_running(self.handle, self.spec),
            )
            return True
        except GantryError:
            return False
        finally:
            client.close()

    def log(self, lines: int = 60) -> str:
        return self.runtime.log_tail(self.handle, self.spec, lines)

    def stop(self) -> None:
        self.runtime.stop(self.handle, self.spec)


class MemoryWatch(threading.Thread):
    """Peak NVML memory per server process, by the model its stub serves."""

    def __init__(self, server: Server) -> None:
        super().__init__(daemon=True)
        self.server, self.peaks, self.stopped = server, {}, threading.Event()

    def _owner(self, pid: int) -> str:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return f"pid {pid}"
        for arg in argv:
            text = arg.decode(errors="replace")
            for model in FRACTIONS:
                if f"/{model}/1/model.py" in text or text.endswith(f"/{model}/1"):
                    return model
        return "tritonserver" if argv and argv[0].endswith(b"tritonserver") else f"pid {pid}"

    def run(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        device = pynvml.nvmlDeviceGetHandleByIndex(0)
        while not self.stopped.is_set():
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(device):
                owner = self._owner(process.pid)
                self.peaks[owner] = max(self.peaks.get(owner, 0), process.usedGpuMemory or 0)
            time.sleep(0.2)


def side_load(server: Server, stop: threading.Event, stats: dict) -> list[threading.Thread]:
    """Embed and rerank requests in a loop, recording each latency."""
    import numpy as np
    import tritonclient.http as httpclient

    def loop(kind: str) -> None:
        client = httpclient.InferenceServerClient(server.url)
        while not stop.is_set():
            started = time.perf_counter()
            if kind == "embed":
                batch = httpclient.InferInput("TEXT", [len(SENTENCES), 1], "BYTES")
                batch.set_data_from_numpy(np.array([[s.encode()] for s in SENTENCES], dtype=object))
                client.infer("embedder", [batch])
            else:
                query = httpclient.InferInput("QUERY", [1, 1], "BYTES")
                query.set_data_from_numpy(np.array([[b"which sentence is about serving?"]], dtype=object))
                passages = httpclient.InferInput("PASSAGES", [1, 8], "BYTES")
                passages.set_data_from_numpy(np.array([[s.encode() for s in SENTENCES[:8]]], dtype=object))
                client.infer("reranker", [query, passages])
            stats.setdefault(kind, []).append((time.perf_counter() - started) * 1000)
        client.close()

    threads = [threading.Thread(target=loop, args=(kind,), daemon=True) for kind in ("embed", "rerank")]
    for thread in threads:
        thread.start()
    return threads


async def generation(url: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    from workers.triton.client import generate_stream

    samples = []
    pending = list(range(requests))

    async def worker() -> None:
        while pending:
            i = pending.pop()
            started = time.perf_counter()
            first = last = None
            tokens = 0
            body = {"text_input": f"Request {i}: tell me about GPUs.", "max_tokens": max_tokens, "stream": True,
                    "temperature": 1.0}  # fmt: skip
            async for event in generate_stream(url, "llm", body):
                if event.get("num_output_tokens"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    tokens += event["num_output_tokens"]
            samples.append(((first - started) * 1000, tokens, (last - first) if last else 0.0))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    ttfts = sorted(s[0] for s in samples)
    return {
        "concurrency": concurrency,
        "requests": requests,
        "ttft_p50_ms": round(ttfts[len(ttfts) // 2], 2),
        "ttft_p99_ms": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 2),
        "tokens_per_s_per_stream": round(statistics.median((t - 1) / d for _, t, d in samples if d > 0 and t > 1), 2),
        "tokens_per_s_total": round(sum(s[1] for s in samples) / wall, 2),
    }


def summarize(latencies: list[float], seconds: float) -> dict:
    ordered = sorted(latencies)
    return {
        "requests_per_s": round(len(ordered) / seconds, 2),
        "p50_ms": round(ordered[len(ordered) // 2], 2) if ordered else None,
        "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2) if ordered else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, required=True, help="the all-MiniLM-L6-v2 tokenizer files")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gantry-gpu-stack"))
    parser.add_argument("--port", type=int, default=18700)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    from deployments.checkpoints import parameter_count

    report: dict = {"gpu": torch.cuda.get_device_name(0), "fractions": FRACTIONS}
    total = torch.cuda.get_device_properties(0).total_memory
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    checkpoints = make_checkpoints(args.work, args.tokenizer)
    report["checkpoints_made_s"] = round(time.perf_counter() - started, 1)
    report["llm_parameters"] = parameter_count(sorted(checkpoints["llm"].glob("*.safetensors")))

    server = Server(args.work, specs(checkpoints, FRACTIONS), args.port)
    watch = MemoryWatch(server)
    watch.start()
    try:
        started = time.perf_counter()
        assert server.wait_ready(), server.log()
        report["launch_to_ready_s"] = round(time.perf_counter() - started, 1)
        # Embed and rerank alone, then the LLM at 1, 8 and 32 streams with them beside it.
        alone: dict = {}
        stop = threading.Event()
        threads = side_load(server, stop, alone)
        time.sleep(10)
        stop.set()
        for thread in threads:
            thread.join()
        report["side_alone"] = {kind: summarize(v, 10) for kind, v in alone.items()}
        report["generation"] = []
        report["side_beside_llm"] = {}
        for concurrency in (1, 8, 32):
            beside: dict = {}
            stop = threading.Event()
            threads = side_load(server, stop, beside)
            t0 = time.perf_counter()
            figures = asyncio.run(generation(server.url, concurrency, max(8, 2 * concurrency), args.max_tokens))
            seconds = time.perf_counter() - t0
            stop.set()
            for thread in threads:
                thread.join()
            report["generation"].append(figures)
            report["side_beside_llm"][str(concurrency)] = {kind: summarize(v, seconds) for kind, v in beside.items()}
        one = report["generation"][0]["tokens_per_s_total"]
        report["batching_gain"] = {
            str(g["concurrency"]): round(g["tokens_per_s_total"] / one, 2) for g in report["generation"]
        }
    finally:
        watch.stopped.set()
        watch.join()
        server.stop()
    report["memory"] = {
        owner: {
            "peak_bytes": peak,
            "budget_bytes": int(FRACTIONS[owner] * total) if owner in FRACTIONS else None,
            "within": peak <= FRACTIONS[owner] * total if owner in FRACTIONS else None,
        }
        for owner, peak in sorted(watch.peaks.items())
    }

    # The cap must bite: 0.02 of the GPU cannot hold 2.2 GB of fp16 weights.
    capped = Server(args.work / "capped", specs(checkpoints, {**FRACTIONS, "llm": 0.02}, only=["llm"]), args.port + 10)
    try:
        loaded = capped.wait_ready(timeout_s=300)
        log = capped.log(200)
    finally:
        capped.stop()
    report["cap_check"] = {
        "fraction": 0.02,
        "budget_bytes": int(0.02 * total),
        "loaded": loaded,
        "out_of_memory_in_log": "out of memory" in log.lower(),
        "log_excerpt": next((line for line in log.splitlines() if "out of memory" in line.lower()), "")[:400],
        "passed": (not loaded) and "out of memory" in log.lower(),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    return (
        0
        if report["cap_check"]["passed"] and all(m["within"] in (True, None) for m in report["memory"].values())
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
