"""A checkpoint served by TensorRT-LLM's LLM API (tensorrtllm_backend's
LLM-API python model, from the image): no engine build, tensor parallel over
the first GPUs its container sees."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings

from common.errors import PermanentError
from deployments.backends.base import (
    Fail,
    Placed,
    PlacementSpec,
    Resolved,
    ServingBackend,
    Target,
    check_max_seq_len,
    kv_budget,
)
from deployments.backends.memory import engine_memory, kv_share, placement_gpus
from deployments.models import Backend, DeploymentModel, Dtype, InstanceKind, ModelKind, RegisteredModel, Runtime
from upstream import trtllm


class LlmApi(ServingBackend):
    key = Backend.LLM_API.value
    kinds = frozenset({ModelKind.LLM.value})
    generative = True
    extras_missing = "Gantry's LLM API route passes only the shared sampling fields so far"
    places_own_gpus = True

    def serves(self, spec: PlacementSpec, model: RegisteredModel) -> bool:
        return model.kind in self.kinds and spec.llm_api

    def check(self, spec: PlacementSpec, model: RegisteredModel, target: Target, fail: Fail) -> Resolved | None:
        """The no-build path: the checkpoint served by the LLM-API backend of an image
        whose TensorRT-LLM release has it, on tensor-parallel GPUs of one model."""
        version = settings.GANTRY_BUILDER_IMAGES.get(target.image, "")
        release = trtllm.release_for(version)
        if target.runtime != Runtime.DOCKER:
            fail("llm_api", "the LLM API runs in the docker runtime, in a TensorRT-LLM image")
        elif release is None or not release.llmapi_model_dir:
            able = [
                i
                for i, v in settings.GANTRY_BUILDER_IMAGES.items()
                if (r := trtllm.release_for(v)) and r.llmapi_model_dir
            ]
            fail(
                "llm_api",
                f"{target.image} has no LLM-API backend Gantry knows of (TensorRT-LLM {version or 'unknown'}); "
                f"images that have one: {', '.join(able) or 'none in GANTRY_BUILDER_IMAGES'}",
            )
        if model.architecture not in (release.llmapi_architectures if release else frozenset()):
            first = trtllm.first_release_serving(model.architecture)
            fail(
                "model",
                f"architecture {model.architecture or '(none)'} is not one TensorRT-LLM {version or '(none)'} serves"
                + (f"; TensorRT-LLM {first.version} and later do" if first else ""),
            )
        if spec.decoding_mode:
            fail("decoding_mode", "the LLM API takes sampling per request; decoding_mode is the tensorrtllm backend's")
        if spec.dtype != Dtype.AUTO:
            fail("dtype", "the LLM API loads the checkpoint in its own dtype; leave it auto")
        check_max_seq_len(spec, model, fail)
        gpus = target.gpus()
        chosen = tuple(sorted(spec.gpu_ids)) or tuple(sorted(gpus)[:1])
        if not chosen or any(i not in gpus for i in chosen):
            fail("gpu_ids", f"the LLM API needs GPUs of {target.host.name}: it has {sorted(gpus) or 'none'}")
            return None
        if model.num_attention_heads and model.num_attention_heads % len(chosen):
            fail(
                "gpu_ids",
                f"{len(chosen)} GPUs (tensor parallel) must divide {model.num_attention_heads} attention heads",
            )
        size = min(gpus[i].memory_total_bytes for i in chosen)
        sequence = min(spec.max_seq_len or model.max_position_embeddings or 2048, 2048)
        tokens = kv_budget(spec, model, None, size, len(chosen), sequence, fail)
        return Resolved(spec=spec, model=model, backend=self.key, gpus=chosen, kv_cache_tokens=tokens)

    def check_deployment(
        self, specs: list[PlacementSpec], resolved: list[Resolved], rows: list[DeploymentModel], host_gpus: list[int]
    ) -> dict[str, list[str]]:
        """At most one LLM-API model per deployment (its model.yaml is found
        through one LLM_CONFIG_PATH), on the lowest of the deployment's GPUs:
        TensorRT-LLM's LLM() takes no device ids, its ranks take the first GPUs
        the container sees, and Docker numbers those from 0 in host order."""
        errors: dict[str, list[str]] = {}
        if sum(1 for spec in specs if spec.llm_api) > 1:
            errors["models"] = ["a deployment serves at most one model through the LLM API"]
        used = sorted({g for row in rows for g in placement_gpus(row, host_gpus)})
        for item, row in zip(resolved, rows, strict=True):
            if row.backend != self.key:
                continue
            mine = sorted(placement_gpus(row, host_gpus))
            first = used[: len(mine)]
            if mine != first:
                index = next(i for i, spec in enumerate(specs) if spec is item.spec)
                errors.setdefault(f"models[{index}].gpu_ids", []).append(
                    f"the LLM API runs on the first {len(mine)} GPU(s) its container sees, here {first} "
                    f"(TensorRT-LLM's LLM() takes no device ids): place it on {first}, or the other models on "
                    "higher GPUs"
                )
        return errors

    def share(self, placement: DeploymentModel) -> float:
        return placement.gpu_memory_fraction  # one executor, whatever the instance count

    def processes_per_gpu(self, placement: DeploymentModel) -> int:
        return 2  # the python model and the executor it drives

    def memory(self, placement: DeploymentModel) -> dict[str, Any]:
        return engine_memory(placement.registered_model, None, placement.gpu_ids, placement.kv_cache_tokens)

    def placed(self, placement: DeploymentModel, kind: str, host_gpus: tuple[int, ...]) -> Placed:
        return Placed(
            triton_name=placement.triton_name, backend=self.key, instance_kind=InstanceKind.GPU.value,
            instance_count=1, gpus=host_gpus, kv_cache_tokens=placement.kv_cache_tokens,
            kv_cache_share=kv_share(placement.kv_cache_free_gpu_mem_fraction),
            max_seq_len=placement.max_seq_len,
            max_num_sequences=placement.max_num_sequences or placement.max_batch_size,
        )  # fmt: skip

    def model_spec(self, placement: DeploymentModel, placed: Placed, devices: tuple[int, ...], image: str) -> Any:
        from triton_server.config import LlmApiSpec

        release = trtllm.release_for(settings.GANTRY_BUILDER_IMAGES.get(image, ""))
        if release is None or not release.llmapi_model_dir:
            raise PermanentError(f"{image} has no LLM-API backend in Gantry's version table")
        if devices != tuple(range(len(devices))):
            # LLM() takes no device ids: its ranks take the container's first GPUs (placements_check).
            raise PermanentError(
                f"{placement.triton_name} would run on the container's first {len(devices)} GPU(s), not on its "
                f"own GPUs {list(placement.gpu_ids)}: place the LLM-API model on the deployment's lowest GPUs"
            )
        return LlmApiSpec(
            name=placement.triton_name,
            checkpoint_path=str(placement.registered_model.folder),
            image_model_dir=release.llmapi_model_dir,
            gpu_device_ids=devices,
            max_batch_size=placed.max_num_sequences,
            max_tokens_in_kv_cache=placed.kv_cache_tokens,
            kv_cache_free_gpu_mem_fraction=placed.kv_cache_share,
            enable_block_reuse=placement.enable_kv_cache_reuse,
            max_seq_len=placed.max_seq_len,
            trust_remote_code=placement.registered_model.trust_remote_code,
            decoupled=placement.decoupled,
        )

    def server_env(self, placement: DeploymentModel, repository: Path) -> dict[str, str]:
        """The LLM-API model finds its model.yaml through LLM_CONFIG_PATH (so a server holds at most one)."""
        from triton_server.config import LLMAPI_CONFIG_FILE

        return {"LLM_CONFIG_PATH": str(repository / placement.triton_name / LLMAPI_CONFIG_FILE)}
