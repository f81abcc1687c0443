"""The Triton model repository on disk: <root>/<model>/config.pbtxt and
<root>/<model>/1/model.py for python-backend models."""

from __future__ import annotations

import shutil
from pathlib import Path

from workers.triton.config import PythonModelSpec, python_model_config, write_config

PYTHON_MODELS = Path(__file__).parent / "python_models"


def write_repository(root: Path, specs: list[PythonModelSpec]) -> list[str]:
    """Write a fresh repository holding exactly ``specs``; return the model names.

    It is built beside ``root`` and swapped in, so a crash half-way leaves the
    previous repository whole, and writing the same specs twice is harmless.
    """
    staging = root.with_name(root.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for spec in specs:
        model_dir = staging / spec.name
        write_config(model_dir, python_model_config(spec))
        version_dir = model_dir / "1"
        version_dir.mkdir()
        shutil.copyfile(PYTHON_MODELS / "sentence_model.py", version_dir / "model.py")
    old = root.with_name(root.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if root.exists():
        root.rename(old)
    staging.rename(root)
    shutil.rmtree(old, ignore_errors=True)
    return [spec.name for spec in specs]
