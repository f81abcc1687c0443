from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.middleware.csrf import CsrfViewMiddleware
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from access.services import bearer_secret, token_user, token_user_if_known
from access.throttles import door_throttled, throttle_identity
from common import jsonbody, metrics
from common.errors import GantryError
from common.problems import problem
from common.ttl_cache import MISSING
from core.api.base import StrictSerializer, error_body, gantry_error, json_type_errors, validated
from core.permissions import CanView, can_view
from inference.embeddings import MAX_TEXT_CHARS, MAX_TEXTS, embed_texts, rerank_passages
from inference.generation import MAX_PROMPT_CHARS, Outcome, Sampling, cached_route, generate, prepare_generation
from upstream import chat_template


class EmbedIn(StrictSerializer):
    texts = serializers.ListField(
        child=serializers.CharField(max_length=MAX_TEXT_CHARS, trim_whitespace=True),
        min_length=1,
        max_length=MAX_TEXTS,
    )
    model = serializers.CharField(max_length=63, required=False, default="", allow_blank=True)


class EmbedOut(serializers.Serializer):
    model = serializers.CharField()
    embeddings = serializers.ListField(child=serializers.ListField(child=serializers.FloatField()))
    similarity = serializers.ListField(
        child=serializers.ListField(child=serializers.FloatField()), help_text="cosine similarity of each pair"
    )


class DeploymentEmbed(APIView):
    """POST /api/deployments/<id>/embed/ {"texts": [...]} -> embeddings and cosine similarities."""

    # Querying a model only reads: viewers may use the playground too.
    permission_classes = [CanView]

    @extend_schema(request=EmbedIn, responses=EmbedOut)
    def post(self, request: Request, pk: int) -> Response:
        data = validated(EmbedIn, request)
        result = embed_texts(deployment_id=pk, texts=data["texts"], model=data["model"])
        return Response(asdict(result))


class RerankIn(StrictSerializer):
    query = serializers.CharField(max_length=MAX_TEXT_CHARS)
    passages = serializers.ListField(
        child=serializers.CharField(max_length=MAX_TEXT_CHARS), min_length=1, max_length=MAX_TEXTS
    )
    model = serializers.CharField(max_length=63, required=False, default="", allow_blank=True)


class RerankOut(serializers.Serializer):
    model = serializers.CharField()
    scores = serializers.ListField(child=serializers.FloatField(), help_text="one per passage, in their order")
    order = serializers.ListField(child=serializers.IntegerField(), help_text="passage indexes, best first")


class DeploymentRerank(APIView):
    """POST /api/deployments/<id>/rerank/ {"query": ..., "passages": [...]} -> one score per passage."""

    permission_classes = [CanView]

    @extend_schema(request=RerankIn, responses=RerankOut)
    def post(self, request: Request, pk: int) -> Response:
        data = validated(RerankIn, request)
        result = rerank_passages(deployment_id=pk, query=data["query"], passages=data["passages"], model=data["model"])
        return Response(asdict(result))


class MessageIn(StrictSerializer):
    role = serializers.ChoiceField(choices=chat_template.ROLES)
    content = serializers.CharField(max_length=MAX_PROMPT_CHARS, allow_blank=True, trim_whitespace=False)


class GenerateIn(StrictSerializer):
    """One generation: a prompt, or chat messages (rendered with the checkpoint's
    chat template), and the sampling fields every LLM route understands."""

    model = serializers.CharField(max_length=63, required=False, default="", allow_blank=True)
    prompt = serializers.CharField(max_length=MAX_PROMPT_CHARS, required=False, trim_whitespace=False)
    messages = MessageIn(many=True, required=False)
    max_tokens = serializers.IntegerField(min_value=1, max_value=32768, default=128)
    temperature = serializers.FloatField(min_value=0.0, max_value=2.0, required=False)
    top_p = serializers.FloatField(min_value=0.0, max_value=1.0, required=False)
    top_k = serializers.IntegerField(min_value=0, max_value=1000, required=False)
    seed = serializers.IntegerField(min_value=0, max_value=2**63 - 1, required=False)
    repetition_penalty = serializers.FloatField(min_value=0.01, max_value=10.0, required=False)
    stop = serializers.ListField(
        child=serializers.CharField(max_length=64, trim_whitespace=False), max_length=8, default=list
    )
    stream = serializers.BooleanField(default=False)

    def validate_top_p(self, value: float) -> float:
        if value <= 0:
            raise serializers.ValidationError("must be greater than 0")
        return value


def _token_may_view_cached(key: str) -> bool | None:
    """Whether the key's user may view, if known without the database; None if not known."""
    user = token_user_if_known(key)
    return None if user is MISSING else can_view(user)


def _token_may_view(key: str) -> bool:
    return can_view(token_user(key))


_UNAUTHENTICATED = problem(401, "not_authenticated", "Authentication credentials were not provided.")


@dataclass
class Answer:
    """What the generate action answers, whichever server path carries it:
    a JSON body with its status, or a stream of server-sent events."""

    status: int = 200
    body: dict[str, Any] | None = None
    events: AsyncIterator[str] | None = None
    retry_after: int = 0  # seconds, with a 429


async def generate_answer(
    pk: int, raw: bytes, may_view: Callable[[], bool], who: str, known: Callable[[], bool | None] = lambda: None
) -> Answer:
    """The generate action's answer (``_answer``), counted and timed for /metrics
    (door "generate"; its key label is who asked: a token's digest or a user)."""
    if not metrics.enabled():
        return await _answer(pk, raw, may_view, who, known, {})
    started, seen = time.monotonic(), {}
    answer = await _answer(pk, raw, may_view, who, known, seen)
    if answer.events is None:
        _observe(answer.status, seen, started, who)
    else:
        answer.events = _observed(answer.events, seen, started, who)
    return answer


def _observe(code: int, seen: dict[str, Any], started: float, who: str) -> None:
    outcome: Outcome | None = seen.get("outcome")
    metrics.observe_door(
        door="generate", alias="", key=who, model=seen.get("model", ""), code=code,
        duration_s=time.monotonic() - started,
        first_token_s=outcome.first_token_after(started) if outcome is not None else None,
        inter_token_s=outcome.inter_token_s if outcome is not None else None,
        prompt_tokens=outcome.prompt_tokens if outcome is not None else None,
        completion_tokens=outcome.completion_tokens if outcome is not None else None,
    )  # fmt: skip


async def _observed(events: AsyncIterator[str], seen: dict[str, Any], started: float, who: str) -> AsyncIterator[str]:
    """``events``, then the request counted (finished, failed or abandoned: it started as a 200).
    Closing this closes ``events``, and with it Triton's request."""
    try:
        async for event in events:
            yield event
    finally:
        await events.aclose()  # type: ignore[attr-defined]
        _observe(200, seen, started, who)


async def _answer(
    pk: int, raw: bytes, may_view: Callable[[], bool], who: str, known: Callable[[], bool | None],
    seen: dict[str, Any],
) -> Answer:  # fmt: skip
    """Validate a generate request, check who asks and start the generation.

    ``may_view`` and the route lookup go to a thread together (they read the
    database); when ``known`` already says who asks and the route is cached,
    the request is prepared on the event loop without that trip. ``who`` (the
    token, or the signed-in user) is throttled like the rest of the API."""
    wait_s = await door_throttled(who)
    if wait_s:
        return Answer(429, problem(429, "throttled", f"Request was throttled. Expected available in {wait_s} seconds."),
                      retry_after=wait_s)  # fmt: skip
    try:
        body = jsonbody.loads(raw)
    except jsonbody.InvalidJson as exc:
        return Answer(400, error_body({"body": [str(exc)]}))
    if not isinstance(body, dict):
        return Answer(400, error_body({"body": ["must be a JSON object"]}))
    serializer = GenerateIn(data=body)
    wrong_types = json_type_errors(serializer, body)
    if wrong_types:
        return Answer(400, error_body(wrong_types))
    if not serializer.is_valid():
        return Answer(400, error_body(serializer.errors))
    data = serializer.validated_data
    sampling = Sampling(
        max_tokens=data["max_tokens"],
        temperature=data.get("temperature"),
        top_p=data.get("top_p"),
        top_k=data.get("top_k"),
        seed=data.get("seed"),
        repetition_penalty=data.get("repetition_penalty"),
        stop=tuple(data["stop"]),
    )

    def check_and_prepare_with(route: dict[str, Any] | None) -> Any:
        return prepare_generation(
            deployment_id=pk,
            model=data["model"],
            prompt=data.get("prompt"),
            messages=[dict(m) for m in data["messages"]] if "messages" in data else None,
            sampling=sampling,
            route=route,
        )

    def check_and_prepare() -> Any:
        return check_and_prepare_with(None) if may_view() else None

    try:
        allowed, route = known(), cached_route(pk, data["model"])
        if allowed is not None and route is not None:
            prepared = None if not allowed else check_and_prepare_with(route)
        else:
            prepared = await sync_to_async(check_and_prepare)()
    except GantryError as exc:
        return Answer(*reversed(gantry_error(exc)))
    if prepared is None:
        return Answer(401, _UNAUTHENTICATED)
    outcome = Outcome()
    seen.update(model=prepared.model, outcome=outcome)
    if data["stream"]:
        return Answer(events=_events(prepared, outcome))
    try:
        text = "".join([piece.text async for piece in generate(prepared, stream=False, outcome=outcome)])
    except GantryError as exc:
        return Answer(*reversed(gantry_error(exc)))
    return Answer(200, {"model": prepared.model, "text": text, "notice": prepared.notice, **outcome.summary()})


@csrf_exempt
async def deployment_generate(request: HttpRequest, pk: int) -> HttpResponse:
    """POST /api/deployments/<id>/generate/: text from the deployment's LLM, as one
    JSON answer or, with "stream": true, server-sent events (one per piece of
    text, then a summary with usage and timings). A client that disconnects
    mid-stream cancels the request inside Triton. Requests with a Token header
    usually arrive by the lean path instead (inference.lean); this view
    serves browser sessions (with Django's CSRF check) and the rest."""
    if request.method != "POST":
        return JsonResponse(problem(405, "method_not_allowed", f'Method "{request.method}" not allowed.'), status=405)
    token = bearer_secret(request.headers.get("Authorization", ""))
    if token is None:
        if settings.SESSION_COOKIE_NAME not in request.COOKIES:
            return JsonResponse(_UNAUTHENTICATED, status=401)
        # A browser session: Django's CSRF check, as for every form post.
        refused = CsrfViewMiddleware(lambda r: None).process_view(request, None, (), {})
        if refused is not None:
            return JsonResponse(problem(403, "permission_denied", "CSRF check failed: reload the page"), status=403)
    answer = await generate_answer(
        pk,
        request.body,
        lambda: can_view(request.user) if token is None else _token_may_view(token),
        who=throttle_identity(token=token, user_pk=None if token else (await request.auser()).pk),
    )
    if answer.events is None:
        response = JsonResponse(answer.body, status=answer.status)
        if answer.retry_after:
            response["Retry-After"] = str(answer.retry_after)
        return response
    response = StreamingHttpResponse(answer.events, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


async def _events(prepared, outcome: Outcome) -> AsyncIterator[str]:  # noqa: ANN001
    try:
        async for piece in generate(prepared, stream=True, outcome=outcome):
            yield _sse({"text": piece.text, "tokens": piece.tokens})
        yield _sse({"done": True, "model": prepared.model, "notice": prepared.notice, **outcome.summary()})
    except GantryError as exc:
        yield _sse({"error": str(exc)})


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"
