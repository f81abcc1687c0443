"""The Triton model repository on disk: <root>/<model>/config.pbtxt, with
<root>/<model>/1/model.py for python-backend models (and gantry_text.py beside
the generating ones, gantry_decode.py and gantry_grammar.py beside the causal
LM), and an empty version folder for the tensorrtllm engine model (the engine
itself stays in its build folder, named by gpt_model_path)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from triton_server.config import (
    CAUSAL_LM_MODEL_FILE,
    DECODE_HELPER_FILE,
    ENGINE_GENERATE_MODEL_FILE,
    GRAMMAR_HELPER_FILE,
    LLMAPI_CONFIG_FILE,
    SEND_HELPER_FILE,
    TEXT_HELPER_FILE,
    CausalLmSpec,
    LlmApiSpec,
    PythonModelSpec,
    TrtllmSpec,
    causal_lm_config,
    llmapi_model_config,
    llmapi_model_yaml,
    python_model_config,
    trtllm_configs,
    write_config,
)

PYTHON_MODELS = Path(__file__).parent / "python_models"
ModelSpec = PythonModelSpec | CausalLmSpec | TrtllmSpec | LlmApiSpec


def model_names(spec: ModelSpec) -> list[str]:
    """The Triton models one placement becomes, in load order."""
    return [spec.name] if isinstance(spec, PythonModelSpec) else spec.model_names


def _python_model(folder: Path, code: str, *helpers: str) -> None:
    """A python-backend model's version folder: its code as model.py, and the helpers it imports."""
    (folder / "1").mkdir()
    shutil.copyfile(PYTHON_MODELS / code, folder / "1" / "model.py")
    for helper in helpers:
        shutil.copyfile(PYTHON_MODELS / helper, folder / "1" / helper)


def _write_model(staging: Path, spec: ModelSpec) -> None:
    if isinstance(spec, PythonModelSpec):
        write_config(staging / spec.name, python_model_config(spec))
        _python_model(staging / spec.name, "sentence_model.py")
        return
    if isinstance(spec, CausalLmSpec):
        write_config(staging / spec.name, causal_lm_config(spec))
        _python_model(
            staging / spec.name,
            CAUSAL_LM_MODEL_FILE,
            TEXT_HELPER_FILE,
            DECODE_HELPER_FILE,
            GRAMMAR_HELPER_FILE,
            SEND_HELPER_FILE,
        )
        return
    if isinstance(spec, LlmApiSpec):
        write_config(staging / spec.name, llmapi_model_config(spec))
        # JSON is YAML: the file needs no YAML writer. The model code is the image's own,
        # linked by a path that resolves inside the container.
        (staging / spec.name / LLMAPI_CONFIG_FILE).write_text(json.dumps(llmapi_model_yaml(spec), indent=2))
        (staging / spec.name / "1").symlink_to(f"{spec.image_model_dir}/1")
        return
    for name, config in trtllm_configs(spec).items():
        write_config(staging / name, config)
        if config.backend == "python":
            _python_model(staging / name, ENGINE_GENERATE_MODEL_FILE, TEXT_HELPER_FILE)
        else:
            (staging / name / "1").mkdir()


def write_repository(root: Path, specs: list[ModelSpec]) -> list[str]:
    """Write a fresh repository holding exactly ``specs``; return the model names.

    It is built beside ``root`` and swapped in, so a crash half-way leaves the
    previous repository whole, and writing the same specs twice is harmless.
    """
    staging = root.with_name(root.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for spec in specs:
        _write_model(staging, spec)
    old = root.with_name(root.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if root.exists():
        root.rename(old)
    staging.rename(root)
    shutil.rmtree(old, ignore_errors=True)
    return [name for spec in specs for name in model_names(spec)]
