"""The memory caps bite. Each python model caps its own PyTorch allocations at
its placement's fraction of the GPU (torch.cuda.set_per_process_memory_fraction
in sentence_model.py and causal_lm_model.py), so a model that would need more
fails on its own instead of taking memory its neighbours were planned.

The planner refuses a fraction that cannot hold what a model needs, so these
checks start the server with Gantry's own config writer and process runtime,
past the planner: the cap is then all that stands between the model and the
GPU. With the cap removed from a model file, its check goes red (the red runs
are in docs/gpu-validation.md)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from django.conf import settings

from common.errors import GantryError
from tests.factories import launch_spec
from tests.gpu.control_plane import TOKENIZER, free_port
from triton_server.client import TritonClient
from triton_server.config import EMBED, Batching, CausalLmSpec, Instances, PythonModelSpec
from triton_server.repository import write_repository
from workers import nvml
from workers.runtimes.process import ProcessRuntime
from workers.untrained import make_untrained_encoder, make_untrained_llm

pytestmark = pytest.mark.gpu
GPU = Instances(count=1, kind="KIND_GPU", gpus=(0,))


class _Server:
    def __init__(self, tmp_path: Path, spec) -> None:  # noqa: ANN001
        port = free_port(3)
        self.launch = launch_spec(
            tmp_path / "deployment", models=[spec.name], http_port=port, grpc_port=port + 1, metrics_port=port + 2
        )
        write_repository(self.launch.repository, [spec])
        self.runtime = ProcessRuntime(tmp_path / "data")
        self.handle = self.runtime.start(self.launch)
        self.client = TritonClient(f"127.0.0.1:{port}")

    def ready(self, timeout_s: float = 300) -> bool:
        try:
            self.client.wait_until_ready(
                self.launch.models,
                timeout_s=timeout_s,
                keep_waiting=lambda: self.runtime.is_running(self.handle, self.launch),
            )
            return True
        except GantryError:
            return False

    def log(self) -> str:
        return self.launch.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.client.close()
        self.runtime.stop(self.handle, self.launch)


def _budget(fraction: float) -> int:
    """What NVML may show a capped process hold: its fraction and a CUDA context."""
    total = nvml.read_inventory().gpus[0].memory_total_bytes
    return int(fraction * total) + settings.GANTRY_GPU_PROCESS_RESERVE_MIB * 2**20


def test_an_embedders_cap_holds_a_batch_that_needs_more_than_its_fraction(tmp_path, report):
    """A BERT-base embedder in fp32 at 0.01 of the GPU: its 0.44 GB of weights fit,
    but 128 texts of 512 tokens in one forward pass need about 1.5 GB more."""
    fraction = 0.01
    folder = make_untrained_encoder(tmp_path / "embedder", kind="embedding", shape="base", tokenizer_dir=TOKENIZER)
    spec = PythonModelSpec(
        name="capped",
        task=EMBED,
        checkpoint_path=str(folder),
        instances=GPU,
        batching=Batching(max_batch_size=128),
        gpu_memory_fraction=fraction,
        dtype="float32",
        max_seq_len=512,
    )
    server = _Server(tmp_path, spec)
    try:
        assert server.ready(), server.log()[-3000:]
        stub_pids = set(server.runtime.pids(server.handle, server.launch)) - {int(server.handle)}
        peak = {"bytes": 0}
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                used = nvml.compute_processes([0])
                peak["bytes"] = max(peak["bytes"], *(used.get(pid, 0) for pid in stub_pids))
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        texts = [" ".join(f"word{i}" for i in range(600))] * 128
        try:
            server.client.embed("capped", texts)
            outcome = "served"
        except GantryError as exc:
            outcome = f"refused: {exc}"[:300]
        time.sleep(1)
        done.set()
        watcher.join()
    finally:
        server.stop()
    report["embedder_cap"] = {
        "fraction": fraction,
        "budget_bytes": _budget(fraction),
        "peak_bytes": peak["bytes"],
        "outcome": outcome,
    }
    assert 0 < peak["bytes"] <= _budget(fraction), report["embedder_cap"]


def test_an_llms_cap_refuses_weights_its_fraction_cannot_hold(tmp_path, report):
    """The ~1B Llama (2.2 GB in 16 bits) given 0.02 of the GPU (1.6 GB on an H100)
    must fail to load, though the GPU has room to spare."""
    fraction = 0.02
    folder = make_untrained_llm(tmp_path / "llm-1b", size="1b", tokenizer_dir=TOKENIZER)
    spec = CausalLmSpec(
        name="capped-llm",
        checkpoint_path=str(folder),
        instances=GPU,
        gpu_memory_fraction=fraction,
        batching=Batching(max_batch_size=8),
        max_num_sequences=8,
        max_seq_len=512,
    )
    server = _Server(tmp_path, spec)
    try:
        loaded = server.ready(timeout_s=240)
        log = server.log()
    finally:
        server.stop()
    report["llm_cap"] = {"fraction": fraction, "loaded": loaded, "out_of_memory": "out of memory" in log.lower()}
    assert not loaded and "out of memory" in log.lower(), log[-3000:]
