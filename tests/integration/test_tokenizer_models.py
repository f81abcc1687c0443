"""The tokenizer ends of an engine's ensemble in a real tritonserver: Gantry's
generated preprocessing and postprocessing configs load, and round-trip text
through the checkpoint's tokenizer (the engine itself needs a GPU and the
TensorRT-LLM image; see tests/unit/workers/triton/test_config.py for its config)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from transformers import AutoTokenizer

from tests.integration.conftest import free_ports
from workers.runtimes.base import LaunchSpec
from workers.runtimes.process import ProcessRuntime
from workers.triton.client import TritonClient
from workers.triton.config import Batching, TrtllmSpec
from workers.triton.repository import write_repository

pytestmark = pytest.mark.integration


def test_preprocessing_and_postprocessing_round_trip_text(tmp_path: Path, minilm_path: Path):
    spec = TrtllmSpec(
        name="llm",
        engine_dir="/nonexistent/engine",
        tokenizer_dir=str(minilm_path),
        batching=Batching(max_batch_size=8),
        gpu_device_ids=(0,),
    )
    repository = tmp_path / "repository"
    write_repository(repository, [spec])
    port = free_ports(3)
    launch = LaunchSpec(
        deployment_id=0, generation=1, repository=repository,
        models=[spec.preprocessing_model, spec.postprocessing_model],
        http_port=port, grpc_port=port + 1, metrics_port=port + 2, log_path=tmp_path / "triton.log",
    )  # fmt: skip
    runtime = ProcessRuntime(tmp_path)
    handle = runtime.start(launch)
    try:
        admin = TritonClient(f"127.0.0.1:{port}")
        admin.wait_until_ready(launch.models, timeout_s=120, keep_waiting=lambda: runtime.is_running(handle, launch))
        admin.close()
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        text = "Gantry serves engines"
        query = httpclient.InferInput("QUERY", [1, 1], "BYTES")
        query.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
        wanted = httpclient.InferInput("REQUEST_OUTPUT_LEN", [1, 1], "INT32")
        wanted.set_data_from_numpy(np.array([[16]], dtype=np.int32))
        pre = client.infer(spec.preprocessing_model, [query, wanted])
        ids = pre.as_numpy("INPUT_ID")[0]
        tokenizer = AutoTokenizer.from_pretrained(minilm_path)
        assert ids.tolist() == tokenizer.encode(text)
        assert pre.as_numpy("REQUEST_INPUT_LEN").tolist() == [[len(ids)]]
        assert pre.as_numpy("OUT_END_ID").tolist() == [[tokenizer.sep_token_id]]

        tokens = httpclient.InferInput("TOKENS_BATCH", [1, 1, len(ids)], "INT32")
        tokens.set_data_from_numpy(ids.reshape(1, 1, -1).astype(np.int32))
        lengths = httpclient.InferInput("SEQUENCE_LENGTH", [1, 1], "INT32")
        lengths.set_data_from_numpy(np.array([[len(ids)]], dtype=np.int32))
        post = client.infer(spec.postprocessing_model, [tokens, lengths])
        assert [t.decode() for t in post.as_numpy("OUTPUT").reshape(-1)] == [text.lower()]
        client.close()
    finally:
        runtime.stop(handle, launch)
