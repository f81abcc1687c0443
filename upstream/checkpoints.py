"""Reading a HuggingFace-format checkpoint folder: its config.json, size and
a content fingerprint. Pure file reading, no ML libraries."""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import ValidationFailed

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# What a loader reads when a folder holds several copies: transformers prefers
# safetensors, then the PyTorch pickles; a GGUF file is read alone.
_LOAD_ORDER = ((".safetensors",), (".bin", ".pt", ".pth"), (".gguf",))
# sentence-transformers' own files beside config.json.
SENTENCE_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.txt", "vocab.json", "tokenizer_config.json")
_CHUNK = 1 << 20
# Written by workers/untrained.py into the checkpoints Gantry makes itself.
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
    sentence_config: dict[str, Any] = field(default_factory=dict)


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
    # Every file is resolved before any is opened: one that links out of the roots
    # (config.json to /etc/passwd) is as far out of reach as a folder there.
    entries = _entries(path)
    for entry in entries:
        if not under_roots(entry, roots):
            raise ValidationFailed({field_name: f"{entry} resolves to {entry.resolve()}, outside the model roots"})
    files = [p for p in entries if p.is_file()]
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError as exc:
        raise ValidationFailed({field_name: f"{path} has no config.json: not a HuggingFace checkpoint"}) from exc
    except (OSError, ValueError) as exc:
        raise ValidationFailed({field_name: f"{config_path} is not valid JSON: {exc}"}) from exc
    if not isinstance(config, dict):
        raise ValidationFailed({field_name: f"{config_path} must hold a JSON object"})
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
        size_bytes=weights_bytes(files),
        fingerprint=fingerprint(path, files),
        tokenizer_files=[name for name in TOKENIZER_FILES if (path / name).is_file()],
        config=config,
        **_tokenizer_extras(path),
        notice=UNTRAINED_NOTICE if (path / UNTRAINED_MARKER).is_file() else "",
        sentence_config=sentence_config(path),
    )


def weights_bytes(files: list[Path]) -> int:
    """The bytes of the weight files a loader reads: the first kind present in
    _LOAD_ORDER, so a .bin copy beside the safetensors is not counted twice."""
    for suffixes in _LOAD_ORDER:
        chosen = [f for f in files if f.name.endswith(suffixes)]
        if chosen:
            return sum(f.stat().st_size for f in chosen)
    return 0


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def sentence_config(path: Path) -> dict[str, Any]:
    """The checkpoint's sentence-transformers configuration, as sentence-transformers
    will apply it: its modules (pooling mode, normalisation, dense layers), the
    input length, prompts and similarity function. Empty without modules.json."""
    modules = _json(path / "modules.json")
    if not isinstance(modules, list):
        return {}
    found: dict[str, Any] = {"modules": []}
    for module in modules:
        if not isinstance(module, dict):
            continue
        kind = str(module.get("type", ""))
        found["modules"].append(kind)
        settings = _json(path / str(module.get("path", "")) / "config.json") or {}
        if kind.endswith("Pooling") and isinstance(settings, dict):
            modes = [k.removeprefix("pooling_mode_").removesuffix("_tokens") for k, v in settings.items()
                     if k.startswith("pooling_mode_") and v is True]  # fmt: skip
            found["pooling"] = "+".join(modes) or "mean"
            found["dimension"] = settings.get("word_embedding_dimension")
        elif kind.endswith("Dense") and isinstance(settings, dict):
            found["dimension"] = settings.get("out_features", found.get("dimension"))
        elif kind.endswith("Normalize"):
            found["normalize"] = True
    found.setdefault("normalize", False)
    bert = _json(path / "sentence_bert_config.json")
    if isinstance(bert, dict) and isinstance(bert.get("max_seq_length"), int):
        found["max_seq_length"] = bert["max_seq_length"]
    own = _json(path / "config_sentence_transformers.json")
    if isinstance(own, dict):
        for key in ("prompts", "default_prompt_name", "similarity_fn_name"):
            if own.get(key):
                found[key] = own[key]
    # A module outside sentence-transformers' own is the checkpoint's code.
    found["custom_modules"] = [m for m in found["modules"] if not m.startswith("sentence_transformers.")]
    found["matryoshka"] = _matryoshka(path)
    return found


# How a model card says its vectors were trained to be cut short: the hub's tag, or the
# loss sentence-transformers' generated cards name (MatryoshkaLoss, matryoshka_dims).
_MATRYOSHKA = re.compile(r"^\s*-\s*matryoshka\s*$|MatryoshkaLoss|matryoshka_dims", re.IGNORECASE | re.MULTILINE)


def _matryoshka(path: Path) -> bool:
    """Whether the model card (README.md) says the embeddings are Matryoshka ones,
    whose first dimensions are an embedding too (OpenAI's ``dimensions``)."""
    try:
        card = (path / "README.md").read_text(errors="replace")[:200_000]
    except OSError:
        return False
    return _MATRYOSHKA.search(card) is not None


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


def _entries(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if not p.name.startswith(".") and (p.is_symlink() or p.is_file()))


def checkpoint_files(path: Path, roots: list[Path]) -> list[Path] | None:
    """The files of the checkpoint folder ``path`` that its fingerprint covers,
    in its order; None when the folder is not here or not a checkpoint, or when
    it or one of its files resolves outside ``roots`` (inspect_checkpoint's rules)."""
    if not under_roots(path, roots) or not (path / "config.json").is_file():
        return None
    entries = _entries(path)
    if not all(under_roots(entry, roots) for entry in entries):
        return None
    return [p for p in entries if p.is_file()]


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
