"""An embedder or reranker on Triton's python backend
(python_models/sentence_model.py), through sentence-transformers: batched by
Triton, one process per instance, on a GPU or the CPU."""

from __future__ import annotations

from typing import Any

from common.words import a
from deployments.backends.base import (
    Fail,
    Placed,
    PlacementSpec,
    Resolved,
    ServingBackend,
    Target,
    batching,
    check_max_seq_len,
    check_precision,
    element_bytes,
    refuse_engine_only,
)
from deployments.backends.memory import resolve_instances
from deployments.models import Backend, DeploymentModel, InstanceKind, ModelKind, RegisteredModel

# A weight's bytes times this must fit a GPU instance's fraction: the weights and room for a batch.
BATCH_ROOM = 1.2


class SentenceModel(ServingBackend):
    key = Backend.PYTHON.value
    kinds = frozenset({ModelKind.EMBEDDING.value, ModelKind.RERANKER.value})

    def check(self, spec: PlacementSpec, model: RegisteredModel, target: Target, fail: Fail) -> Resolved | None:
        """Its precision, its input length (up to the checkpoint's positions), and
        weights its fraction can hold."""
        if spec.engine_build is not None:
            fail("engine_build", f"{model.name} is {a(model.kind)} model, not an llm")
        if spec.llm_api:
            fail("llm_api", f"{model.name} is {a(model.kind)} model, not an llm")
        refuse_engine_only(spec, fail, f"{a(model.kind)} model")
        if spec.max_num_sequences is not None:
            fail("max_num_sequences", f"{a(model.kind)} model generates no sequences: max_batch_size bounds a batch")
        host_gpus = target.gpus()
        kind, gpus = resolve_instances(spec.instance_kind, spec.gpu_ids, host_gpus)
        check_precision(spec, kind, gpus, host_gpus, fail)
        check_max_seq_len(spec, model, fail)
        if kind == InstanceKind.GPU:
            weights = (model.parameter_count or model.size_bytes // 4) * element_bytes(spec, kind)
            for index in gpus:
                gpu = host_gpus.get(index)
                if gpu is not None and spec.gpu_memory_fraction * gpu.memory_total_bytes < weights * BATCH_ROOM:
                    fail(
                        "gpu_memory_fraction",
                        f"{spec.gpu_memory_fraction:g} of GPU {index}'s {gpu.memory_total_bytes / 2**30:.0f} GiB "
                        f"cannot hold {model.name}'s {weights / 2**30:.2f} GiB of weights and room for a batch",
                    )
        return Resolved(spec=spec, model=model, backend=self.key)

    def model_spec(self, placement: DeploymentModel, placed: Placed, devices: tuple[int, ...], image: str) -> Any:
        from triton_server.config import EMBED, RERANK, Instances, PythonModelSpec

        model = placement.registered_model
        return PythonModelSpec(
            name=placement.triton_name,
            task=RERANK if model.kind == ModelKind.RERANKER else EMBED,
            checkpoint_path=str(model.folder),
            batching=batching(placement),
            instances=Instances(count=placed.instance_count, kind=placed.instance_kind, gpus=devices),
            gpu_memory_fraction=placement.gpu_memory_fraction,
            max_seq_len=placed.max_seq_len,
            dtype=placement.dtype,
            trust_remote_code=model.trust_remote_code,
        )
