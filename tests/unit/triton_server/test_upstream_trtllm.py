"""The tensorrt_llm model config Gantry writes, against the upstream template of
each tensorrtllm_backend release it serves (tests/data/upstream: the template's
inputs, outputs and parameter keys per release tag, with the tag's commit, and
the script that read them): every input and output Gantry declares is the
template's, of the same type and shape, never optional where the template
requires it, and every parameter key is
one the release's backend reads. A name the backend does not know is ignored
by it without a word, so this is where such a slip is caught."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from deployments import build_spec
from triton_server.config import Batching, TrtllmSpec, tensorrtllm_model_config
from upstream import trtllm

UPSTREAM = json.loads((Path(__file__).parents[2] / "data/upstream/tensorrtllm_backend.json").read_text())


def _config(release: str) -> mc.ModelConfig:
    """With every optional parameter and tensor Gantry may write for the release."""
    spec = TrtllmSpec(name="llm", engine_dir="/engines/llm", tokenizer_dir="/models/llm",
                      batching=Batching(max_batch_size=8), gpu_device_ids=(0, 1), max_tokens_in_paged_kv_cache=4096,
                      decoding_mode="top_k_top_p",
                      num_return_sequences=trtllm.RELEASES[release].num_return_sequences)  # fmt: skip
    return tensorrtllm_model_config(spec)


def test_the_templates_cover_releases_gantry_serves():
    assert set(UPSTREAM) <= set(trtllm.RELEASES)
    assert all(len(facts["commit"]) == 40 and facts["source"].endswith("config.pbtxt") for facts in UPSTREAM.values())


@pytest.mark.parametrize("release", sorted(UPSTREAM))
def test_the_engine_models_inputs_and_outputs_are_the_templates(release: str):
    upstream = UPSTREAM[release]
    config = _config(release)
    assert config.backend == upstream["backend"]
    for tensor in config.input:
        assert tensor.name in upstream["inputs"], f"{tensor.name} is no input of {release}'s template"
        declared = upstream["inputs"][tensor.name]
        mine = {"data_type": mc.DataType.Name(tensor.data_type), "dims": list(tensor.dims)}
        assert mine == {"data_type": declared["data_type"], "dims": declared["dims"]}, tensor.name
        # Gantry may require what the template leaves optional (its generate model always sends
        # input_ids, optional from 0.16 for encoder inputs), never leave optional what it requires.
        assert declared["optional"] or not tensor.optional, f"{tensor.name} is required by {release}'s template"
    for tensor in config.output:
        assert tensor.name in upstream["outputs"], f"{tensor.name} is no output of {release}'s template"
        assert {"data_type": mc.DataType.Name(tensor.data_type), "dims": list(tensor.dims)} == upstream["outputs"][
            tensor.name
        ], tensor.name
    # What the template requires (not optional) Gantry declares.
    required = {name for name, facts in upstream["inputs"].items() if not facts["optional"]}
    assert required <= {tensor.name for tensor in config.input}
    # Several sequences exactly where the template takes them (the release table says so).
    assert ("num_return_sequences" in upstream["inputs"]) == trtllm.RELEASES[release].num_return_sequences
    assert ("sequence_index" in {t.name for t in config.output}) == ("sequence_index" in upstream["outputs"])


@pytest.mark.parametrize("release", sorted(UPSTREAM))
def test_every_parameter_is_one_the_releases_backend_reads(release: str):
    unknown = set(_config(release).parameters) - set(UPSTREAM[release]["parameters"])
    assert not unknown, f"{release}'s template has no {sorted(unknown)}"


BUILD = json.loads((Path(__file__).parents[2] / "data/upstream/trtllm_build.json").read_text())
# trtllm-build's plugin and feature flags come from plugin.py's cli_plugin_args (see the data's note).
PLUGIN_FLAGS = {"--gemm_plugin", "--gpt_attention_plugin", "--context_fmha", "--use_paged_context_fmha",
                "--remove_input_padding"}  # fmt: skip


@pytest.mark.parametrize("release", sorted(BUILD))
def test_the_release_tables_build_flags_are_the_upstream_parsers(release: str):
    upstream = set(BUILD[release]["flags"])
    assert trtllm.RELEASES[release].build_flags - PLUGIN_FLAGS <= upstream
    paths = trtllm.BuildPaths(checkpoint=Path("/m"), converted=Path("/c"), engine=Path("/e"), timing_cache=Path("/t"))
    tools = trtllm.Toolchain(python=["python3"], trtllm_build=["trtllm-build"], examples_dir="/app/examples")
    build = trtllm.compose(dict(build_spec.DEFAULTS), trtllm.RELEASES[release], paths, tools, "LlamaForCausalLM")[-1]
    composed = {arg for arg in build.argv if arg.startswith("--")}
    assert composed - PLUGIN_FLAGS <= upstream, sorted(composed - PLUGIN_FLAGS - upstream)
