"""An engine build's spec: its settings and defaults, the rules that need the
checkpoint, the host and the TensorRT-LLM release, and the cache key that
makes two identical requests one build."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from django.conf import settings

from common.errors import ValidationFailed
from common.words import a
from deployments.models import Inspection, ModelKind, RegisteredModel
from hosts.models import GpuHost
from upstream import trtllm

MIN_TIME_LIMIT_S = 10
NATIVE = "native"  # the builder "image" that means tensorrt_llm installed on the host itself

DEFAULTS: dict[str, Any] = {
    "dtype": "float16",
    "quantization": "none",
    "gemm_plugin": "auto",
    "gpt_attention_plugin": "auto",
    "context_fmha": True,
    "paged_context_fmha": True,
    "remove_input_padding": True,
    "max_batch_size": 8,
    "max_input_len": 1024,
    "max_seq_len": 2048,
    "max_num_tokens": 8192,
    "max_beam_width": 1,
    "tp_size": 1,
    "pp_size": 1,
    "workers": 1,
    "gpu_ids": [],
    "allow_seq_len_over_max_positions": False,
}


def _cc(value: str) -> tuple[int, int]:
    major, _, minor = value.partition(".")
    return int(major or 0), int(minor or 0)


def builder_choices(host: GpuHost) -> dict[str, str]:
    """Builder images usable on ``host`` -> their TensorRT-LLM version: allow-listed
    and present there (the agent reports their digests), plus ``native`` where the
    host has tensorrt_llm installed."""
    present = (host.builders or {}).get("images", {})
    choices = {image: version for image, version in settings.GANTRY_BUILDER_IMAGES.items() if image in present}
    native = (host.builders or {}).get("native", "")
    if native:
        choices[NATIVE] = native
    return choices


def image_digest(host: GpuHost, image: str) -> str:
    if image == NATIVE:
        return f"native:tensorrt_llm-{(host.builders or {}).get('native', '')}"
    return (host.builders or {}).get("images", {}).get(image, "")


def normalize_spec(raw: dict[str, Any], *, model: RegisteredModel, host: GpuHost, image: str) -> dict[str, Any]:
    """The full build spec with defaults filled in, or ValidationFailed naming
    each field and the rule it broke. Types and ranges are the serializer's job;
    here are the rules that need the checkpoint, the host and the release."""
    unknown = sorted(set(raw) - set(DEFAULTS))
    if unknown:
        raise ValidationFailed({name: "is not a build setting" for name in unknown})
    spec = {**DEFAULTS, **raw}
    errors: dict[str, list[str]] = {}

    def fail(name: str, message: str) -> None:
        errors.setdefault(name, []).append(message)

    if model.kind != ModelKind.LLM:
        fail("model", f"{model.name} is {a(model.kind)} model; engines are built from llm checkpoints")
    if model.inspection != Inspection.READY:
        fail(
            "model", f"{model.name} is not inspected yet ({model.inspection}): {model.inspection_message}".rstrip(": ")
        )

    choices = builder_choices(host)
    release = None
    if image not in choices:
        if image != NATIVE and image not in settings.GANTRY_BUILDER_IMAGES:
            allowed = ", ".join(sorted(settings.GANTRY_BUILDER_IMAGES)) or "none configured"
            fail("image", f"{image!r} is not an allow-listed builder image (GANTRY_BUILDER_IMAGES: {allowed})")
        elif image == NATIVE:
            fail("image", f"{host.name} has no tensorrt_llm installed for native builds")
        elif (host.builders or {}).get("docker_error"):
            fail("image", f"{host.name} could not read its images: {host.builders['docker_error']}")
        else:
            fail("image", f"{image} is not on {host.name}: pull it there first (its agent reports the images it has)")
    else:
        release = trtllm.release_for(choices[image])
        if release is None:
            known = ", ".join(trtllm.RELEASES)
            fail("image", f"TensorRT-LLM {choices[image]} of {image} is not in Gantry's version table ({known})")

    if release is not None and model.architecture == trtllm.GPT_OSS:
        serving = trtllm.first_release_serving(trtllm.GPT_OSS)
        fail(
            "model",
            "gpt-oss has no engine build in TensorRT-LLM (trtllm-build has no converter for it): deploy the "
            f"checkpoint through the LLM API (llm_api), with TensorRT-LLM {serving.version if serving else '1.0.0'} "
            "or later",
        )
    elif release is not None and model.architecture not in release.model_dirs:
        supported = ", ".join(release.architectures)
        fail("model", f"architecture {model.architecture or '(none)'} is not supported; supported: {supported}")

    if spec["dtype"] not in trtllm.DTYPES:
        fail("dtype", f"must be one of {', '.join(trtllm.DTYPES)}")
    if spec["quantization"] not in trtllm.QUANTIZATIONS:
        fail("quantization", f"must be one of {', '.join(trtllm.QUANTIZATIONS)}")
    for plugin in ("gemm_plugin", "gpt_attention_plugin"):
        if spec[plugin] not in trtllm.PLUGIN_CHOICES:
            fail(plugin, f"must be one of {', '.join(trtllm.PLUGIN_CHOICES)}")
    if spec["paged_context_fmha"] and (not spec["context_fmha"] or spec["gpt_attention_plugin"] == "disable"):
        fail("paged_context_fmha", "needs context_fmha and the gpt_attention_plugin")

    if spec["max_seq_len"] < spec["max_input_len"]:
        fail("max_seq_len", f"must be at least max_input_len ({spec['max_input_len']})")
    limit = model.max_position_embeddings
    if limit and spec["max_seq_len"] > limit and not spec["allow_seq_len_over_max_positions"]:
        fail(
            "max_seq_len",
            f"exceeds the checkpoint's max_position_embeddings ({limit}); "
            "set allow_seq_len_over_max_positions to build it anyway",
        )
    if not spec["paged_context_fmha"] and spec["max_num_tokens"] < spec["max_input_len"]:
        fail("max_num_tokens", "must be at least max_input_len unless paged_context_fmha chunks the context")

    world = spec["tp_size"] * spec["pp_size"]
    heads = model.num_attention_heads
    if heads and heads % spec["tp_size"]:
        fail("tp_size", f"must divide the checkpoint's {heads} attention heads")
    if model.num_layers and spec["pp_size"] > model.num_layers:
        fail("pp_size", f"cannot exceed the checkpoint's {model.num_layers} layers")
    if spec["workers"] > world:
        fail("workers", f"must be at most tp_size * pp_size ({world})")

    gpus = {gpu.index: gpu for gpu in host.gpus.all()}
    gpu_ids = sorted(spec["gpu_ids"]) or sorted(gpus)[:world]
    if world > len(gpus):
        fail("tp_size", f"tp_size * pp_size = {world} GPUs, but {host.name} has {len(gpus)}")
    elif spec["gpu_ids"]:
        missing = [i for i in gpu_ids if i not in gpus]
        if missing:
            fail("gpu_ids", f"{host.name} has no GPU {', '.join(map(str, missing))}")
        elif len(set(gpu_ids)) != world:
            fail("gpu_ids", f"must name exactly tp_size * pp_size = {world} distinct GPUs")
    chosen = [gpus[i] for i in gpu_ids if i in gpus]
    if len({(g.name, g.compute_capability) for g in chosen}) > 1:
        fail("gpu_ids", "the build's GPUs must all be the same model")
    if chosen:
        cc = _cc(chosen[0].compute_capability)
        for name, choice in (("dtype", spec["dtype"]), ("quantization", spec["quantization"])):
            need = trtllm.MIN_COMPUTE_CAPABILITY.get(choice)
            if need and cc < need:
                fail(
                    name,
                    f"{choice} needs compute capability {need[0]}.{need[1]} or higher; "
                    f"{chosen[0].name} has {chosen[0].compute_capability}",
                )
    if errors:
        raise ValidationFailed(errors)
    spec["gpu_ids"] = gpu_ids
    spec["trtllm_version"] = release.version
    spec["gpu_name"] = chosen[0].name
    spec["compute_capability"] = chosen[0].compute_capability
    return spec


def cache_key(*, fingerprint: str, spec: dict[str, Any], image_digest: str) -> str:
    """Equal keys mean equal engines: same checkpoint content, spec, image and GPU model."""
    # Which GPUs of the same model ran it does not change the engine.
    material = {
        "fingerprint": fingerprint,
        "spec": {k: v for k, v in spec.items() if k != "gpu_ids"},
        "image_digest": image_digest,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
