"""Generating text with a ready deployment's LLM, whatever serves it (the
transformers model, the TensorRT-LLM ensemble, the LLM API): every route takes
the same generate interface, so this module never looks at a route's internals.

``prepare_generation`` (sync: database reads) checks the request against the
deployment and the checkpoint and renders chat messages with the checkpoint's
template; ``generate`` (async) streams the model's pieces of text with their
timings. The REST generate action, the browser's chat and the gateway all go
through both.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from common.errors import InvalidTransition, NotFound, TransientError, ValidationFailed
from common.ttl_cache import TtlCache
from deployments import live_figures
from deployments.backends import GENERATIVE_BACKENDS, backend_of, served_context
from deployments.models import Deployment, DeploymentModel
from inference.balancing import Endpoint, Tries, answering, finish
from inference.tool_calls import reads_tool_calls
from triton_server.client import generate_stream
from upstream import chat_template

MAX_PROMPT_CHARS = 200_000
DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True)
class Sampling:
    """What a caller may ask of generation; None leaves the model's default.

    Beyond the interface every route shares: OpenAI's presence and frequency
    penalties, a logit bias ((token id, added logit) pairs), a grammar (``guide``:
    guide type and text, as TensorRT-LLM's guided decoding names them), ``n``
    sequences of one prompt, and log-probabilities (``logprobs``: None, or how
    many alternatives beside each chosen token; alternatives are the extra
    ``top_logprobs``). A route that does not take one
    of them refuses it by the name ``names`` gives it.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    guide: tuple[str, str] | None = None
    n: int = 1
    logprobs: int | None = None
    names: dict[str, str] = field(default_factory=dict, compare=False)  # extra -> the caller's field

    def extras(self) -> list[str]:
        """The extras (EXTRAS) this request asks for."""
        asked = {
            "penalties": bool(self.presence_penalty or self.frequency_penalty),
            "logit_bias": bool(self.logit_bias),
            "guide": self.guide is not None,
            "n": self.n > 1,
            "logprobs": self.logprobs is not None,
            "top_logprobs": bool(self.logprobs),
        }
        return [extra for extra in EXTRAS if asked[extra]]


# What a generative backend may take beyond the shared interface (ServingBackend.generation_extras).
EXTRAS = ("penalties", "logit_bias", "guide", "n", "logprobs", "top_logprobs")


@dataclass(frozen=True)
class Prepared:
    """A checked request, ready for Triton."""

    endpoints: list[Endpoint]  # the deployment's answering replicas
    model: str  # the Triton model (the placement's name)
    inputs: dict[str, Any]
    max_tokens: int
    notice: str = ""  # what the user must know about the checkpoint (e.g. untrained)


@dataclass
class Piece:
    """Text the model added to sequence ``index``, the tokens that text took, and
    (when asked) their log-probabilities: OpenAI's entries, token by token."""

    text: str
    tokens: int
    index: int = 0
    logprobs: list[dict[str, Any]] | None = None


@dataclass
class Outcome:
    """How a generation ended, for usage and the playground's figures."""

    prompt_tokens: int | None = None  # None: not reported (yet)
    completion_tokens: int = 0  # all sequences together
    finish_reason: str = "stop"  # the first sequence's (finish_reasons has each)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    sequence_tokens: dict[int, int] = field(default_factory=dict)
    streamed: bool = True
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    ended: float | None = None
    replica_id: int | None = None  # the replica that answered

    @property
    def time_to_first_token_ms(self) -> float | None:
        return None if self.first_token_at is None else round((self.first_token_at - self.started) * 1000, 2)

    @property
    def first_token_s(self) -> float | None:
        """Streamed: seconds from the start to the first token (unknown to a whole answer's client)."""
        return self.first_token_after(self.started)

    def first_token_after(self, started: float) -> float | None:
        """Streamed: seconds from ``started`` (a door's arrival, on time.monotonic) to the first token."""
        return None if self.first_token_at is None or not self.streamed else self.first_token_at - started

    @property
    def inter_token_s(self) -> float | None:
        """Streamed: the mean time between tokens after the first (AIPerf's inter-token latency)."""
        if self.first_token_at is None or not self.streamed or self.completion_tokens < 2:
            return None
        return ((self.ended or time.monotonic()) - self.first_token_at) / (self.completion_tokens - 1)

    @property
    def tokens_per_s(self) -> float | None:
        """Streamed: output tokens per second after the first one arrived (the
        decode rate). Not streamed: all of them over the whole request."""
        if self.first_token_at is None or self.ended is None:
            return None
        if not self.streamed:
            span = self.ended - self.started
            return round(self.completion_tokens / span, 2) if span > 0 else None
        span = self.ended - self.first_token_at
        return round((self.completion_tokens - 1) / span, 2) if span > 0 and self.completion_tokens > 1 else None

    def summary(self) -> dict[str, Any]:
        return {
            "finish_reason": self.finish_reason,
            "usage": {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": None if self.prompt_tokens is None else self.prompt_tokens + self.completion_tokens,
            },
            "time_to_first_token_ms": self.time_to_first_token_ms,
            "duration_ms": None if self.ended is None else round((self.ended - self.started) * 1000, 2),
            "tokens_per_s": self.tokens_per_s,
        }


@dataclass(frozen=True)
class Route:
    """What generation needs of an llm placement: the replicas that serve it now
    and what its checkpoint says (the chat template and its special tokens, the
    context a sequence may hold, the notice a page shows beside it)."""

    endpoints: list[Endpoint]
    triton_name: str
    model_name: str
    chat_template: str
    special_tokens: dict[str, Any]
    context: int | None
    notice: str
    extras: frozenset[str] = frozenset()  # what its backend takes beyond the shared interface
    extras_missing: str = ""  # why not the rest


# Routes of ready LLM placements, kept a second per process so a busy door does
# not read the database per request: a replica stopped meanwhile is tried for
# at most that second (and its failed request retried on another).
_routes = TtlCache()


def cached_route(deployment_id: int, model: str) -> Route | None:
    """The route of a ready placement if it was read less than a second ago."""
    return _routes.get((deployment_id, model))


def read_route(deployment_id: int, model: str) -> Route:
    """Where a deployment's LLM (named, or its first) is served and what its checkpoint
    says, in one query; NotFound, ValidationFailed or InvalidTransition when it cannot
    be asked now."""
    candidates = DeploymentModel.objects.select_related("deployment", "registered_model", "engine_build").filter(
        deployment_id=deployment_id, backend__in=GENERATIVE_BACKENDS
    )
    placement = (candidates.filter(triton_name=model) if model else candidates).order_by("triton_name").first()
    if placement is None:
        name = Deployment.objects.filter(pk=deployment_id).values_list("name", flat=True).first()
        if name is None:
            raise NotFound(f"deployment {deployment_id} does not exist")
        raise ValidationFailed({"model": f"{name} serves no llm" + (f" named {model!r}" if model else "")})
    route = route_of(placement)
    if not route.endpoints:
        deployment = placement.deployment
        raise InvalidTransition(f"{deployment.name} is {deployment.status}; start it and wait until it is ready")
    return _routes.put((deployment_id, model), route)


def route_of(placement: DeploymentModel) -> Route:
    """The route of an llm placement (loaded with its deployment and registered model)."""
    checkpoint = placement.registered_model
    extras, missing = backend_of(placement).extras(placement)
    return Route(
        endpoints=answering(placement.deployment_id),
        triton_name=placement.triton_name,
        model_name=checkpoint.name,
        chat_template=checkpoint.chat_template,
        special_tokens=checkpoint.special_tokens,
        context=served_context(placement),
        notice=checkpoint.notice,
        extras=extras,
        extras_missing=missing,
    )


def prepare_generation(
    *,
    deployment_id: int | None = None,
    model: str = "",
    prompt: str | None = None,
    messages: list[dict[str, Any]] | None = None,
    sampling: Sampling,
    route: Route | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> Prepared:
    """Check a generation request against the deployment and its checkpoint.

    Exactly one of ``prompt`` and ``messages``; chat messages become the prompt
    through the checkpoint's chat template. ValidationFailed names the field.
    Give the deployment (and its model's name, or its first llm), or the
    ``route`` a door already holds (cached_route, the gateway's alias), which
    spares the database read. ``tools`` (OpenAI's definitions) are rendered by
    the template too, which must write them in the format inference.tool_calls reads.
    """
    if route is None:
        if deployment_id is None:
            raise TypeError("prepare_generation needs deployment_id or route")
        route = read_route(deployment_id, model)
    if (prompt is None) == (messages is None):
        raise ValidationFailed({"prompt": "send either prompt or messages, not both and not neither"})
    if messages is not None:
        if not messages:
            raise ValidationFailed({"messages": "must hold at least one message"})
        if tools and not reads_tool_calls(route.chat_template):
            raise ValidationFailed(
                {"tools": f"{route.model_name}'s chat template does not write tool calls in the Hermes format "
                          "(<tool_call>), the one Gantry reads"}
            )  # fmt: skip
        prompt = chat_template.render(
            route.chat_template, messages, special_tokens=route.special_tokens, model_name=route.model_name,
            tools=tools,
        )  # fmt: skip
    # What the person sent is named: a chat's messages are its prompt once rendered.
    field = "prompt" if messages is None else "messages"
    if not prompt or not prompt.strip():
        raise ValidationFailed({field: "must not be empty"})
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ValidationFailed({field: f"must be at most {MAX_PROMPT_CHARS} characters (rendered as one prompt)"})
    context = route.context
    if context and sampling.max_tokens >= context:
        raise ValidationFailed(
            {"max_tokens": f"must be below {context}, {route.model_name}'s context (prompt and output together)"}
        )
    inputs: dict[str, Any] = {"text_input": prompt, "max_tokens": sampling.max_tokens}
    for name, value in (
        ("temperature", sampling.temperature),
        ("top_p", sampling.top_p),
        ("top_k", sampling.top_k),
        ("random_seed", sampling.seed),
        ("repetition_penalty", sampling.repetition_penalty),
    ):
        if value is not None:
            inputs[name] = value
    if sampling.stop:
        inputs["stop_words"] = list(sampling.stop)
    refused = [extra for extra in sampling.extras() if extra not in route.extras]
    if refused:
        name = sampling.names.get(refused[0], refused[0])
        raise ValidationFailed({name: f"is not supported by {route.model_name}'s route: {route.extras_missing}"})
    inputs.update(_extra_inputs(sampling))
    return Prepared(
        endpoints=route.endpoints, model=route.triton_name, inputs=inputs, max_tokens=sampling.max_tokens,
        notice=route.notice,
    )  # fmt: skip


def _extra_inputs(sampling: Sampling) -> dict[str, Any]:
    """The transformers model's inputs for what the request asks beyond the shared interface."""
    inputs: dict[str, Any] = {}
    if sampling.presence_penalty:
        inputs["presence_penalty"] = sampling.presence_penalty
    if sampling.frequency_penalty:
        inputs["frequency_penalty"] = sampling.frequency_penalty
    if sampling.logit_bias:
        inputs["logit_bias_ids"] = [token for token, _ in sampling.logit_bias]
        inputs["logit_bias_values"] = [value for _, value in sampling.logit_bias]
    if sampling.guide is not None:
        inputs["guided_decoding_guide_type"], inputs["guided_decoding_guide"] = sampling.guide
    if sampling.n > 1:
        inputs["num_return_sequences"] = sampling.n
    if sampling.logprobs is not None:
        inputs["return_log_probs"] = True
        inputs["top_log_probs"] = sampling.logprobs
    return inputs


async def generate(prepared: Prepared, *, stream: bool, outcome: Outcome) -> AsyncIterator[Piece]:
    """The model's pieces of text as they come; ``outcome`` is filled in as they do.

    With ``stream`` off the model answers once with the whole text. Stopping the
    iteration early (a client that went away) cancels the request in Triton. It
    goes to the best of the deployment's replicas (inference.balancing); one that
    fails before its first response is retried once on another, never after.
    """
    outcome.streamed = stream
    try:
        async for event in _replica_stream(prepared, {**prepared.inputs, "stream": stream}, outcome):
            text = _text(event.get("text_output"))
            added = int(_first(event.get("num_output_tokens"), 0))
            index = int(_first(event.get("sequence_index"), 0))
            prompt_tokens = _first(event.get("num_input_tokens"), None)
            if prompt_tokens is not None:
                outcome.prompt_tokens = int(prompt_tokens)
            outcome.completion_tokens += added
            outcome.sequence_tokens[index] = outcome.sequence_tokens.get(index, 0) + added
            if (text or added) and outcome.first_token_at is None:
                outcome.first_token_at = time.monotonic()
            logprobs = event.get("log_probs")
            if text or logprobs:
                yield Piece(text=text, tokens=added, index=index, logprobs=_logprobs(logprobs))
        outcome.ended = time.monotonic()
        outcome.finish_reasons = {
            index: "length" if tokens >= prepared.max_tokens else "stop"
            for index, tokens in sorted(outcome.sequence_tokens.items())
        }
        outcome.finish_reason = outcome.finish_reasons.get(0, "stop")
    finally:  # finished, failed or abandoned: what the replica's users saw
        if outcome.replica_id is not None and outcome.completion_tokens:
            live_figures.record_soon(
                replica_id=outcome.replica_id, model=prepared.model, first_token_s=outcome.first_token_s,
                inter_token_s=outcome.inter_token_s, tokens=outcome.completion_tokens,
            )  # fmt: skip


async def _replica_stream(
    prepared: Prepared, inputs: dict[str, Any], outcome: Outcome
) -> AsyncIterator[dict[str, Any]]:
    """Triton's responses from the best replica; one that fails before its first
    response is replaced once by another (inference.balancing.Tries)."""
    tries = Tries(prepared.endpoints)
    while True:
        endpoint = tries.next()
        outcome.replica_id = endpoint.replica_id
        answered = False
        try:
            async for event in generate_stream(endpoint.url, prepared.model, inputs, endpoint.channel):
                answered = True
                yield event
        except TransientError as error:
            if answered:
                finish(endpoint, failed=True)
                raise
            tries.failed(endpoint, error)
            continue
        except BaseException:
            tries.answered(endpoint)
            raise
        tries.answered(endpoint)
        return


def _first(value: Any, default: Any) -> Any:
    while isinstance(value, list):
        if not value:
            return default
        value = value[0]
    return default if value is None else value


def _logprobs(value: Any) -> list[dict[str, Any]] | None:
    """The transformers model's log_probs output (JSON, one entry per token), as a list."""
    value = _first(value, None)
    if value is None:
        return None
    entries = json.loads(value)
    return entries if isinstance(entries, list) else None


def _text(value: Any) -> str:
    value = _first(value, "")
    return value if isinstance(value, str) else str(value)
