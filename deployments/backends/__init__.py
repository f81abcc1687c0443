"""The serving backends, one module each behind ``base.ServingBackend``, and
their registry. A new backend is one module and one line in ``BACKENDS``
(with its value in ``deployments.models.Backend``): placement, the GPU plan,
the replica's plan, the host's model specs and the served context all ask
here.

Order matters where several serve one kind: an llm placement that names an
engine build is tensorrtllm's, one that asks for the LLM API is the LLM API's,
any other is transformers'.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from deployments.backends.base import Placed, PlacementSpec, ServingBackend
from deployments.backends.llm_api import LlmApi
from deployments.backends.memory import resolve_instances
from deployments.backends.sentence import SentenceModel
from deployments.backends.tensorrtllm import TensorrtLlm
from deployments.backends.transformers import Transformers
from deployments.models import DeploymentModel, ModelKind, RegisteredModel

BACKENDS: tuple[ServingBackend, ...] = (TensorrtLlm(), LlmApi(), Transformers(), SentenceModel())
_BY_KEY = {backend.key: backend for backend in BACKENDS}
# The backends that generate text, all behind the same interface (text_input,
# max_tokens, sampling fields, stream -> text_output).
GENERATIVE_BACKENDS = frozenset(backend.key for backend in BACKENDS if backend.generative)
# The model kinds this version can place in a deployment.
SERVABLE_KINDS = tuple(kind for kind in ModelKind.values if any(kind in backend.kinds for backend in BACKENDS))


def backend_for(spec: PlacementSpec, model: RegisteredModel) -> ServingBackend | None:
    """The backend a placement request asks for (None: its model's kind is served by none)."""
    return next((backend for backend in BACKENDS if backend.serves(spec, model)), None)


def backend_of(placement: DeploymentModel | str) -> ServingBackend:
    """The backend a placement row (or a Backend value) is served by."""
    return _BY_KEY[placement if isinstance(placement, str) else placement.backend]


def triton_models(placement: DeploymentModel) -> list[str]:
    """The Triton models a placement becomes, in load order."""
    return backend_of(placement).triton_models(placement.triton_name)


def served_context(placement: DeploymentModel) -> int | None:
    """The most tokens (prompt and output) one sequence of the placement may hold."""
    return backend_of(placement).served_context(placement)


def placed(placement: DeploymentModel, gpu_map: dict[int, int], gpu_count: int) -> Placed:
    """The placement as a replica whose GPUs ``gpu_map`` maps onto a host with
    ``gpu_count`` GPUs runs it: its instance kind resolved there ("auto": a GPU
    when the host has one) and its GPUs the host's."""
    kind, logical = resolve_instances(placement.instance_kind, placement.gpu_ids, range(gpu_count))
    return backend_of(placement).placed(placement, kind, tuple(gpu_map.get(g, g) for g in logical))


def replica_plan(
    placements: Iterable[DeploymentModel], gpu_map: dict[int, int], gpu_count: int, generation: int
) -> dict[str, Any]:
    """What a replica runs, as Replica.plan stores it: the generation it was
    resolved for, each placement's Placed, and every host GPU its server uses."""
    models = [placed(p, gpu_map, gpu_count) for p in placements]
    return {
        "generation": generation,
        "gpus": sorted({g for item in models for g in item.gpus}),
        "models": [item.as_json() for item in models],
    }
