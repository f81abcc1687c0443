"""Writes tensorrtllm_backend.json: what tests/unit/triton_server/test_upstream_trtllm.py
checks Gantry's generated tensorrt_llm model config against, read from the
tensorrt_llm model's config.pbtxt template of each tensorrtllm_backend release
tag (its inputs with type, dims and optional; its outputs; its parameter keys).
Only these facts are kept, not the template.

Usage: python tests/data/upstream/extract_tensorrtllm_backend.py PATH_TO_A_CLONE_OF_tensorrtllm_backend
(a clone with its tags; from v0.20.0 the templates live in TensorRT-LLM's own
repository, under triton_backend/).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

TAGS = ("v0.12.0", "v0.16.0")
TEMPLATE = "all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt"
REPOSITORY = "triton-inference-server/tensorrtllm_backend"


def facts(clone: Path, tag: str) -> dict:
    text = subprocess.run(["git", "-C", str(clone), "show", f"{tag}:{TEMPLATE}"], capture_output=True, text=True,
                          check=True).stdout  # fmt: skip
    commit = subprocess.run(["git", "-C", str(clone), "rev-parse", f"{tag}^{{commit}}"], capture_output=True,
                            text=True, check=True).stdout.strip()  # fmt: skip
    # The template's ${placeholders}, filled as tools/fill_template.py would for the
    # tensorrtllm backend: the backend's name, a type, a flag, else a number or a word.
    text = text.replace('"${triton_backend}"', '"tensorrtllm"')
    text = re.sub(r"data_type:\s*\$\{\w+\}", "data_type: TYPE_FP16", text)
    text = re.sub(r"decoupled:\s*\$\{\w+\}", "decoupled: true", text)
    text = re.sub(r'"\$\{\w+\}"', '"x"', text)
    text = re.sub(r"\$\{\w+\}", "1", text)
    config = text_format.Parse(text, mc.ModelConfig())
    return {
        "source": f"{REPOSITORY} {tag}:{TEMPLATE}",
        "commit": commit,
        "backend": config.backend,
        "inputs": {
            i.name: {"data_type": mc.DataType.Name(i.data_type), "dims": list(i.dims), "optional": i.optional}
            for i in config.input
        },  # fmt: skip
        "outputs": {o.name: {"data_type": mc.DataType.Name(o.data_type), "dims": list(o.dims)} for o in config.output},
        "parameters": sorted(config.parameters),
    }


if __name__ == "__main__":
    clone = Path(sys.argv[1])
    out = Path(__file__).with_name("tensorrtllm_backend.json")
    out.write_text(json.dumps({tag.lstrip("v"): facts(clone, tag) for tag in TAGS}, indent=1, sort_keys=True) + "\n")
    sys.stdout.write(f"{out}\n")
