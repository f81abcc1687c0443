"""Talking to a running Triton server over HTTP: tritonclient for health,
the repository API and tensor inference, and Triton's generate extension
(``/v2/models/<m>/generate_stream``, server-sent events) for text generation,
asynchronously, so the web tier streams tokens without a thread per request.

The web tier's calls (generate_stream, infer_async) go over pooled
connections of its own (triton_server.http1). Callers get numpy arrays, dicts
and Gantry's TransientError / PermanentError, never tritonclient's or the
connections' exceptions. This is the one module through which every door
reaches Triton: the host worker, the playground, the generate action and the
gateway.
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from common.errors import ContextExceeded, PermanentError, TransientError
from triton_server import http1

# The header Triton's restricted APIs (model repository, logging) expect.
ADMIN_HEADER = "gantry-admin-key"
_CONNECT_TIMEOUT_S = 5.0
_NETWORK_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Channel:
    """How the web tier reaches a Triton on another host: that host's channel
    (mutual TLS, common.pki), asked for the server by name."""

    server_name: str  # p<port>.h<host id>.gantry
    context: ssl.SSLContext


@dataclass(frozen=True)
class Readiness:
    live: bool
    ready: bool
    models: dict[str, bool]
    cause: str = ""  # why the server or a model is not ready, in words ("" when all are)

    @property
    def all_models_ready(self) -> bool:
        return bool(self.models) and all(self.models.values())


def _unreachable(exc: BaseException) -> str:
    """A failed call in words: refused, timed out, or Triton's own error."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, ConnectionRefusedError) or "refused" in text.lower():
        return "connection refused (is it running?)"
    if isinstance(exc, TimeoutError) or "timed out" in text.lower() or "timeout" in text.lower():
        return f"timed out ({text})"
    return text


class TritonClient:
    """A small client for one server, addressed as host:http_port."""

    def __init__(
        self,
        url: str,
        admin_secret: str = "",
        *,
        load_timeout_s: float = 900.0,
        network_timeout_s: float = _NETWORK_TIMEOUT_S,
    ) -> None:
        """``load_timeout_s`` bounds a repository load or unload, which blocks until
        the model is loaded (a large engine takes minutes); ``network_timeout_s``
        every other call."""
        self.url = url
        self._admin_headers = {ADMIN_HEADER: admin_secret} if admin_secret else None
        self._client = httpclient.InferenceServerClient(
            url, connection_timeout=_CONNECT_TIMEOUT_S, network_timeout=network_timeout_s
        )
        self._repository = httpclient.InferenceServerClient(
            url, connection_timeout=_CONNECT_TIMEOUT_S, network_timeout=load_timeout_s
        )

    def close(self) -> None:
        self._client.close()
        self._repository.close()

    def readiness(self, models: list[str]) -> Readiness:
        """Server liveness/readiness and each model's readiness; unreachable reads as not live."""
        try:
            live = self._client.is_server_live()
            ready = live and self._client.is_server_ready()
            status = {name: live and self._client.is_model_ready(name) for name in models}
        except (InferenceServerException, OSError, ConnectionError) as exc:
            cause = f"the server at {self.url} did not answer: {_unreachable(exc)}"
            return Readiness(live=False, ready=False, models={name: False for name in models}, cause=cause)
        missing = [name for name, ok in status.items() if not ok]
        if not live:
            cause = "the server says it is not live"
        elif missing:
            reasons = self._reasons()
            cause = "; ".join(f"{name} {reasons.get(name) or 'is not ready'}" for name in missing)
        else:
            cause = "" if ready else "the server says it is not ready"
        return Readiness(live=live, ready=ready, models=status, cause=cause)

    def _reasons(self) -> dict[str, str]:
        """Each model's state and Triton's reason for it, from the repository index
        (it needs the admin secret; without it, none)."""
        try:
            index = self._client.get_model_repository_index(headers=self._admin_headers)
        except (InferenceServerException, OSError, ConnectionError):
            return {}
        return {
            entry["name"]: f"is {entry.get('state', 'unknown').lower()}"
            + (f": {entry['reason']}" if entry.get("reason") else "")
            for entry in index
            if isinstance(entry, dict) and "name" in entry
        }

    def wait_until_ready(
        self,
        models: list[str],
        *,
        timeout_s: float,
        keep_waiting: Callable[[], bool] = lambda: True,
        poll_s: float = 0.5,
        server_ready: bool = True,
    ) -> Readiness:
        """Poll until the server and every model are ready.

        Raises TransientError on timeout and PermanentError when
        ``keep_waiting`` says the wait no longer matters (the server died, or
        the deployment was stopped meanwhile). ``server_ready=False`` waits
        for the models only: Triton reports a server not ready while any model
        it tried failed, even one since removed.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.readiness(models)
            if (state.ready or not server_ready) and state.live and state.all_models_ready:
                return state
            if not keep_waiting():
                raise PermanentError("stopped waiting for readiness")
            if time.monotonic() >= deadline:
                missing = [name for name, ok in state.models.items() if not ok]
                raise TransientError(
                    f"not ready after {timeout_s:.0f}s (server live={state.live}, models not ready: {missing}"
                    + (f"; {state.cause}" if state.cause else "")
                    + ")"
                )
            time.sleep(poll_s)

    def load(self, model: str) -> None:
        """Load ``model`` from the repository, or reload it if its files changed (explicit model control)."""
        self._repository_call(self._repository.load_model, model)

    def unload(self, model: str) -> None:
        self._repository_call(self._repository.unload_model, model)

    def _repository_call(self, call: Callable[..., None], model: str) -> None:
        try:
            call(model, headers=self._admin_headers)
        except InferenceServerException as exc:
            raise PermanentError(f"{model}: {exc.message()}") from exc
        except (OSError, ConnectionError) as exc:
            raise TransientError(f"{model}: server unreachable at {self.url}: {exc}") from exc

    def embed(self, model: str, texts: list[str]) -> np.ndarray:
        """Embeddings of ``texts`` from a Gantry embedding model, one row per text."""
        batch = np.array([[t.encode("utf-8")] for t in texts], dtype=object)
        return self._infer(model, {"TEXT": batch}, "EMBEDDING")

    def _infer(self, model: str, arrays: dict[str, np.ndarray], output: str) -> np.ndarray:
        requests = []
        for name, array in arrays.items():
            request = httpclient.InferInput(name, list(array.shape), "BYTES")
            request.set_data_from_numpy(array)
            requests.append(request)
        try:
            result = self._client.infer(model, requests, outputs=[httpclient.InferRequestedOutput(output)])
        except InferenceServerException as exc:
            status = str(exc.status() or "")
            if status in {"400", "404", "StatusCode.INVALID_ARGUMENT", "StatusCode.NOT_FOUND"}:
                raise PermanentError(f"{model}: {exc.message()}") from exc
            raise TransientError(f"{model}: {exc.message()}") from exc
        except (OSError, ConnectionError) as exc:
            raise TransientError(f"{model}: server unreachable at {self.url}: {exc}") from exc
        return result.as_numpy(output)


# --- text generation (Triton's generate extension) ------------------------------------


def _server(url: str, channel: Channel | None) -> http1.Server:
    if channel is None:
        return http1.Server.at(url)
    return http1.Server.at(url, channel.context, channel.server_name)


async def generate_stream(
    url: str, model: str, inputs: dict[str, Any], channel: Channel | None = None
) -> AsyncIterator[dict[str, Any]]:
    """Each response of ``model`` for ``inputs`` (the generate interface's fields),
    as Triton streams them. Leaving the loop early closes the connection, which
    Triton turns into a cancelled request (the model stops generating).

    PermanentError when Triton refuses the request (bad input, unknown model),
    TransientError when the server cannot be reached or fails mid-way.
    """
    try:
        answer = await http1.post(_server(url, channel), f"/v2/models/{model}/generate_stream", orjson.dumps(inputs))
    except http1.Unreachable as exc:
        raise TransientError(f"{model}: server unreachable at {url}: {exc}") from exc
    finished = False
    try:
        if answer.status != 200:
            raise _refusal(model, answer.status, (await answer.read()).decode("utf-8", "replace"))
        rest = b""
        async for part in answer.parts():
            *lines, rest = (rest + part).split(b"\n")
            for line in lines:
                if line.startswith(b"data:"):
                    event = orjson.loads(line[5:])
                    if "error" in event:
                        raise _refused(f"{model}: {event['error']}")
                    yield event
        finished = True
    except http1.Broken as exc:
        raise TransientError(f"{model}: the stream from {url} broke: {exc}") from exc
    finally:
        if finished:
            answer.release()
        else:
            answer.close()  # the client went away or failed: drop the connection so Triton cancels


def _refusal(model: str, status: int, body: str) -> Exception:
    """Triton's refusal of a request: its error message, without the JSON or the
    server-sent event framing it came in."""
    text = body.strip()
    if text.startswith("data:"):
        text = text.splitlines()[0][5:].strip()
    try:
        message = json.loads(text).get("error", text)
    except (ValueError, AttributeError):
        message = text
    if status in (400, 404):
        return _refused(f"{model}: {message}")
    return TransientError(f"{model}: Triton answered {status}: {message}")


# How the transformers LLM (python_models/causal_lm_model.py) refuses a prompt that,
# with max_tokens, does not fit its context.
_CONTEXT_EXCEEDED = "exceed the model's context"


def _refused(message: str) -> PermanentError:
    return ContextExceeded(message) if _CONTEXT_EXCEEDED in message else PermanentError(message)


# --- tensor inference from the event loop (the gateway) --------------------------------


async def infer_async(
    url: str, model: str, inputs: dict[str, np.ndarray], channel: Channel | None = None
) -> dict[str, np.ndarray]:
    """Every output of ``model`` for ``inputs`` (numpy arrays; object arrays are
    BYTES), over the pooled connections. Outputs come back in Triton's binary
    tensor extension, so a batch of embeddings is never printed as JSON numbers.

    PermanentError when Triton refuses the request, TransientError when it
    cannot be reached.
    """
    header: dict[str, Any] = {"inputs": [_json_tensor(name, array) for name, array in inputs.items()]}
    header["parameters"] = {"binary_data_output": True}
    try:
        answer = await http1.post(_server(url, channel), f"/v2/models/{model}/infer", orjson.dumps(header))
        try:
            body = await answer.read()
        finally:
            answer.release()
    except http1.Unreachable as exc:
        raise TransientError(f"{model}: server unreachable at {url}: {exc}") from exc
    except http1.Broken as exc:
        raise TransientError(f"{model}: the answer from {url} broke: {exc}") from exc
    if answer.status != 200:
        raise _refusal(model, answer.status, body.decode("utf-8", "replace"))
    header_length = answer.headers.get("inference-header-content-length")
    return _outputs(body, int(header_length) if header_length else len(body))


_NUMPY_OF = {"FP32": np.float32, "FP16": np.float16, "FP64": np.float64, "INT32": np.int32, "INT64": np.int64}


def _json_tensor(name: str, array: np.ndarray) -> dict[str, Any]:
    if array.dtype == object:
        data = [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in array.reshape(-1)]
        datatype = "BYTES"
    else:
        data, datatype = array.reshape(-1).tolist(), _DATATYPE_OF[array.dtype.type]
    return {"name": name, "shape": list(array.shape), "datatype": datatype, "data": data}


_DATATYPE_OF = {v: k for k, v in _NUMPY_OF.items()}


def _outputs(body: bytes, header_length: int) -> dict[str, np.ndarray]:
    header = json.loads(body[:header_length])
    offset, arrays = header_length, {}
    for output in header.get("outputs", []):
        size = output.get("parameters", {}).get("binary_data_size")
        dtype = _NUMPY_OF.get(output["datatype"])
        if size is None:  # answered as JSON after all
            arrays[output["name"]] = np.array(output.get("data", []), dtype=dtype).reshape(output["shape"])
            continue
        raw = body[offset : offset + size]
        offset += size
        if dtype is not None:  # (string outputs are skipped: the doors that call this never need them)
            arrays[output["name"]] = np.frombuffer(raw, dtype=dtype).reshape(output["shape"])
    return arrays
