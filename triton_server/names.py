"""How Gantry names a placement's Triton models: a TensorRT-LLM placement is
two, its engine (``<name>-engine``) and, in front of it, the generate model
clients call by the placement's own name. Every other placement is one model
of its name."""

from __future__ import annotations

ENGINE_SUFFIX = "-engine"


def engine_model(name: str) -> str:
    """The Triton model that holds placement ``name``'s TensorRT-LLM engine."""
    return f"{name}{ENGINE_SUFFIX}"


def placement_of(model: str) -> str:
    """The placement a Triton model serves (an engine's is the one in front of it)."""
    return model.removesuffix(ENGINE_SUFFIX)
