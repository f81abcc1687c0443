"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

from common.errors import (
    ContextExceeded,
    GantryError,
    InvalidTransition,
    NotFound,
    PermanentError,
    TransientError,
    ValidationFailed,
)

# How long a client should wait before asking a model that is not ready, or unreachable, again.
NOT_READY_RETRY_S = 5


class GatewayError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [] if self.retry_after is None else [(b"retry-after", str(self.retry_after).encode())]


def bad_request(param: str, message: str, code: str | None = None) -> GatewayError:
    return GatewayError(400, f"{param}: {message}", param=param, code=code)


# The generate interface's inputs the model may refuse by name, and the request field each came from.
_MODEL_INPUTS = {"guided_decoding_guide": "response_format"}


def from_gantry(exc: GantryError, *, alias: str, prompt_param: str | None = None) -> GatewayError:
    """A model path's error, as a client of the gateway should see it (``prompt_param``:
    the field that carried the prompt, named when it does not fit the context; a
    model's refusal of an input, by the request's field it came from)."""
    if isinstance(exc, ContextExceeded):
        message = str(exc).split(": ", 1)[-1]
        return GatewayError(400, f"{message[:1].upper()}{message[1:]}.", param=prompt_param,
                            code="context_length_exceeded")  # fmt: skip
    if isinstance(exc, ValidationFailed):
        param, rule = next(iter(exc.errors.items()), ("", str(exc)))
        rule = " ".join(rule) if isinstance(rule, list) else str(rule)
        return bad_request(param, rule)
    if isinstance(exc, NotFound):
        return model_not_found(alias)
    if isinstance(exc, InvalidTransition):  # the deployment is not ready
        return not_ready(alias, str(exc))
    if isinstance(exc, TransientError):
        return GatewayError(
            503, f"model {alias!r} is unavailable: {exc}", type="server_error", code="model_unavailable",
            retry_after=NOT_READY_RETRY_S,
        )  # fmt: skip
    if isinstance(exc, PermanentError):
        for name, param in _MODEL_INPUTS.items():
            _, found, rule = str(exc).partition(f"{name}: ")
            if found:
                return bad_request(param, f"the model refused it: {rule}")
        return GatewayError(400, f"the model refused the request: {exc}", code="model_refused")
    return GatewayError(500, str(exc), type="server_error")


def model_not_found(alias: str) -> GatewayError:
    return GatewayError(
        404,
        f"The model {alias!r} does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def not_ready(alias: str, why: str) -> GatewayError:
    return GatewayError(
        503, f"model {alias!r} is not ready: {why}", type="server_error", code="model_not_ready",
        retry_after=NOT_READY_RETRY_S,
    )  # fmt: skip


def database_away() -> GatewayError:
    """Gantry's database cannot be reached, and what the request needed from it was not kept."""
    return GatewayError(
        503, "Gantry cannot reach its database right now; try again in a few seconds.", type="server_error",
        code="service_unavailable", retry_after=NOT_READY_RETRY_S,
    )  # fmt: skip
