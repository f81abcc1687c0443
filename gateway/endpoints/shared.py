"""What every /v1 endpoint shares: naming a request's key, alias, model and
outcome for /metrics, authenticating and resolving with that noted, and
counting a request in the key's usage (settling its token reservation)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from common import metrics
from common.errors import GantryError
from gateway import access
from gateway.access import Caller, Target
from gateway.errors import from_gantry
from gateway.metering import Admission, settle, usage
from inference.generation import Outcome


@dataclass
class Seen:
    """What /metrics says of one gateway request (common.metrics.observe_door)."""

    started: float = field(default_factory=time.monotonic)
    code: int = 0
    key: str = ""
    alias: str = ""
    model: str = ""
    outcome: Outcome | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def observe(self) -> None:
        outcome = self.outcome
        metrics.observe_door(
            door="gateway", alias=self.alias, key=self.key, model=self.model, code=self.code or 500,
            duration_s=time.monotonic() - self.started,
            first_token_s=None if outcome is None else outcome.first_token_after(self.started),
            inter_token_s=None if outcome is None else outcome.inter_token_s,
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
        )  # fmt: skip


SEEN: ContextVar[Seen] = ContextVar("gateway_seen")


def note(**labels: Any) -> None:
    """Name this request's key, alias, model or outcome for /metrics (while it is on)."""
    seen = SEEN.get(None)
    if seen is not None:
        for name, value in labels.items():
            setattr(seen, name, value)


async def authenticate(headers: list[tuple[bytes, bytes]]) -> Caller:
    caller = await access.authenticate(headers)
    note(key=str(caller.key_id))
    return caller


async def resolve(caller: Caller, name: str, kind: str, endpoint: str) -> Target:
    target = await access.resolve(caller, name, kind, endpoint)
    note(alias=target.alias, model=target.triton_name)
    return target


_settlements: set[asyncio.Task] = set()


def count(
    caller: Caller, alias: str, admission: Admission, *, requests: int = 1, prompt: int = 0, completion: int = 0,
    failed: bool = False,
) -> None:  # fmt: skip
    """Count a request (finished, failed or abandoned) in the key's usage, and settle
    its token reservation to what it used."""
    note(prompt_tokens=prompt, completion_tokens=completion)
    usage.count(caller.key_id, alias, requests=requests, prompt=prompt, completion=completion, failed=failed)
    if admission.window:
        task = asyncio.get_running_loop().create_task(settle(caller, admission, prompt + completion))
        _settlements.add(task)
        task.add_done_callback(_settlements.discard)


@contextmanager
def failures_counted(caller: Caller, target: Target, admission: Admission, *, requests: int = 1) -> Iterator[None]:
    """A model's refusal or an unreachable server: counted as failed (its reservation
    returned), answered in OpenAI's shape."""
    try:
        yield
    except GantryError as exc:
        count(caller, target.alias, admission, requests=requests, failed=True)
        raise from_gantry(exc, alias=target.alias) from exc
