"""Reading a HuggingFace-format checkpoint folder: its config.json, size and
a content fingerprint. Pure file reading, no ML libraries."""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deployments.errors import ValidationFailed

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.txt", "vocab.json", "tokenizer_config.json")
_CHUNK = 1 << 20
# Written by workers/untrained_llm.py into the checkpoints Gantry makes itself.
UNTRAINED_MARKER = "gantry_untrained.json"
UNTRAINED_NOTICE = "untrained: random weights, so it answers with random words"


@dataclass(frozen=True)
class CheckpointInfo:
    architecture: str
    model_type: str
    hidden_size: int | None
    num_layers: int | None
    max_position_embeddings: int | None
    torch_dtype: str
    size_bytes: int
    fingerprint: str
    num_attention_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None
    parameter_count: int | None = None
    tokenizer_files: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    chat_template: str = ""
    special_tokens: dict[str, str] = field(default_factory=dict)
    notice: str = ""


def under_roots(path: Path, roots: list[Path]) -> bool:
    resolved = path.resolve()
    return any(resolved == root or root in resolved.parents for root in roots)


def inspect_checkpoint(path: Path, *, roots: list[Path], field_name: str = "path") -> CheckpointInfo:
    """Validate and describe the checkpoint in ``path``.

    Raises ValidationFailed naming ``field_name`` when the folder is outside the
    configured roots, missing, or not a HuggingFace checkpoint.
    """
    if not path.is_absolute():
        raise ValidationFailed({field_name: "must be an absolute path"})
    if not under_roots(path, roots):
        allowed = ", ".join(str(r) for r in roots)
        raise ValidationFailed({field_name: f"must be under one of the configured model roots ({allowed})"})
    if not path.is_dir():
        raise ValidationFailed({field_name: f"{path} is not a folder on this host"})
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError as exc:
        raise ValidationFailed({field_name: f"{path} has no config.json: not a HuggingFace checkpoint"}) from exc
    except (OSError, ValueError) as exc:
        raise ValidationFailed({field_name: f"{config_path} is not valid JSON: {exc}"}) from exc
    if not isinstance(config, dict):
        raise ValidationFailed({field_name: f"{config_path} must hold a JSON object"})
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    if not any(p.name.endswith(WEIGHT_SUFFIXES) for p in files):
        raise ValidationFailed({field_name: f"{path} holds no weights (*.safetensors or *.bin)"})

    architectures = config.get("architectures") or []
    hidden = _int_or_none(config.get("hidden_size") or config.get("d_model") or config.get("n_embd"))
    heads = _int_or_none(config.get("num_attention_heads") or config.get("n_head"))
    head_dim = _int_or_none(config.get("head_dim")) or (hidden // heads if hidden and heads else None)
    return CheckpointInfo(
        architecture=str(architectures[0]) if architectures else "",
        model_type=str(config.get("model_type", "")),
        hidden_size=hidden,
        num_attention_heads=heads,
        # Grouped-query attention keeps fewer KV heads; without the key every head has its own.
        num_kv_heads=_int_or_none(config.get("num_key_value_heads")) or heads,
        head_dim=head_dim,
        vocab_size=_int_or_none(config.get("vocab_size")),
        parameter_count=parameter_count(files),
        num_layers=_int_or_none(config.get("num_hidden_layers") or config.get("n_layer")),
        max_position_embeddings=_int_or_none(config.get("max_position_embeddings") or config.get("n_positions")),
        torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or ""),
        size_bytes=sum(p.stat().st_size for p in files),
        fingerprint=fingerprint(path, files),
        tokenizer_files=[name for name in TOKENIZER_FILES if (path / name).is_file()],
        config=config,
        **_tokenizer_extras(path),
        notice=UNTRAINED_NOTICE if (path / UNTRAINED_MARKER).is_file() else "",
    )


def _tokenizer_extras(path: Path) -> dict[str, Any]:
    """The chat template and special tokens from the tokenizer files (transformers
    keeps the template in chat_template.jinja, or in tokenizer_config.json)."""
    try:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        tokenizer_config = {}
    if not isinstance(tokenizer_config, dict):
        tokenizer_config = {}
    template = tokenizer_config.get("chat_template") or ""
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template", "") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), "")
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text()
    tokens = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = tokenizer_config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return {"chat_template": template if isinstance(template, str) else "", "special_tokens": tokens}


def parameter_count(files: list[Path]) -> int | None:
    """Parameters from the safetensors headers (8-byte length, then JSON with each
    tensor's dtype and shape): the floating-point tensors, so integer buffers such
    as position_ids do not count. None when the weights are not all safetensors."""
    weights = [f for f in files if f.name.endswith(WEIGHT_SUFFIXES)]
    if not weights or any(not f.name.endswith(".safetensors") for f in weights):
        return None
    total = 0
    try:
        for file in weights:
            with file.open("rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                if length > 100_000_000:
                    return None
                header = json.loads(handle.read(length))
            for name, tensor in header.items():
                if name != "__metadata__" and str(tensor.get("dtype", "")).startswith(("F", "BF")):
                    total += math.prod(tensor.get("shape") or [1])
    except (OSError, ValueError, struct.error, AttributeError):
        return None  # not a readable safetensors file: the count stays unknown
    return total


def fingerprint(root: Path, files: list[Path]) -> str:
    """sha256 over each file's relative path and content, in a stable order."""
    digest = hashlib.sha256()
    for file in files:
        digest.update(str(file.relative_to(root)).encode())
        digest.update(b"\0")
        with file.open("rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and value > 0 else None
