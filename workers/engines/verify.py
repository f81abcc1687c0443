"""Checks around a build: the GPUs are the ones it records, and what
trtllm-build wrote matches the request (version, parallelism, limits, one
engine per rank), with every artifact's size and sha256."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from django.conf import settings

from deployments.models import EngineBuild
from workers import nvml
from workers.jobs import JobFailed


def verify_gpus(build: EngineBuild) -> str:
    """The GPUs the build runs on are the model and SM it records (an engine is
    only valid on the architecture it was built on)."""
    found = {gpu.index: gpu for gpu in nvml.read_inventory().gpus}
    for index in build.gpu_ids:
        gpu = found.get(index)
        if gpu is None or (gpu.name, gpu.compute_capability) != (build.gpu_name, build.compute_capability):
            seen = f"{gpu.name} (SM {gpu.compute_capability})" if gpu else "missing"
            raise JobFailed(
                f"GPU {index} is {seen}; the build was requested for {build.gpu_name} (SM {build.compute_capability})",
            )
    return f"[gantry] building on GPU {', '.join(map(str, build.gpu_ids))}: {build.gpu_name}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def verify_engine(build: EngineBuild, engine_dir: Path) -> dict:
    """Read what trtllm-build wrote and check it against the request; returns the
    fields to record, or raises JobFailed naming the mismatch."""
    try:
        config = json.loads((engine_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise JobFailed(f"the engine's config.json is missing or unreadable: {exc}") from exc
    pretrained = config.get("pretrained_config") or {}
    mapping = pretrained.get("mapping") or {}
    build_config = config.get("build_config") or {}
    plugin_config = build_config.get("plugin_config") or {}
    spec = build.spec
    problems = []
    version = str(config.get("version", ""))
    if version != build.trtllm_version:
        problems.append(f"TensorRT-LLM version {version or '(none)'} instead of {build.trtllm_version}")
    for name, want in (("tp_size", build.tp_size), ("pp_size", build.pp_size)):
        if mapping.get(name, 1) != want:
            problems.append(f"{name} {mapping.get(name)} instead of {want}")
    for name in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens"):
        if build_config.get(name) != spec[name]:
            problems.append(f"{name} {build_config.get(name)} instead of {spec[name]}")
    engines = sorted(engine_dir.glob("rank*.engine"))
    if len(engines) != build.world_size:
        problems.append(f"{len(engines)} rank engines instead of {build.world_size}")
    if problems:
        raise JobFailed("the engine does not match the request: " + "; ".join(problems))
    artifacts = [
        {"name": path.name, "size": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(engine_dir.iterdir())
        if path.is_file()
    ]
    return {
        "artifacts": artifacts,
        "build_config": {k: v for k, v in build_config.items() if k != "plugin_config"},
        "plugin_config": plugin_config,
        "engine_config": config,
    }


def engine_files_problem(build: EngineBuild) -> str | None:
    """What is gone or changed of a succeeded build's engine folder on this host,
    by name and size (hashing gigabytes on every check would cost too much)."""
    folder = Path(build.output_dir)
    if not build.output_dir or not folder.is_dir():
        return f"its folder {folder} is not on {settings.GANTRY_HOST_NAME}"
    gone, changed = [], []
    for artifact in build.artifacts:
        try:
            size = (folder / artifact["name"]).stat().st_size
        except OSError:
            gone.append(artifact["name"])
            continue
        if size != artifact.get("size"):
            changed.append(f"{artifact['name']} ({size} bytes, built as {artifact.get('size')})")
    problems = ([f"{', '.join(gone)} gone"] if gone else []) + ([f"{', '.join(changed)} changed"] if changed else [])
    return f"in {folder}: {'; '.join(problems)}" if problems else None
