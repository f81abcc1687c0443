"""GET /v1/models and /v1/models/<alias>: the aliases a key may name."""

from __future__ import annotations

from typing import Any

from common.asgi_io import send_json
from gateway.access import Caller, db, visible_aliases
from gateway.errors import GatewayError


async def models(caller: Caller, path: str, send: Any) -> None:
    listed = await db(visible_aliases)(caller)
    if path in ("/v1/models", "/v1/models/"):
        await send_json(send, 200, {"object": "list", "data": listed})
        return
    name = path[len("/v1/models/") :]
    found = next((m for m in listed if m["id"] == name), None)
    if found is None:
        raise GatewayError(404, f"The model {name!r} does not exist or you do not have access to it.",
                           param="model", code="model_not_found")  # fmt: skip
    await send_json(send, 200, found)
