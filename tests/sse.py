"""One streamed OpenAI chat completion read to its end, the way a client that
must not lose a stream reads it: the chunks it got, its finish_reason, whether
[DONE] came and any error event. The drain and autoscaling tests and
bench/drain.py judge a cut stream by it."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import requests


@dataclass(frozen=True)
class StreamEnd:
    pieces: int
    finish_reason: str | None
    done: bool
    error: str | None
    ended: float  # time.monotonic() when it ended

    @property
    def cut(self) -> bool:
        """Ended without its finish_reason and [DONE], or with an error."""
        return self.error is not None or not self.done or self.finish_reason is None


def chat_stream(
    url: str, key: str, body: dict, *, begun: threading.Semaphore | None = None, timeout_s: float = 900
) -> StreamEnd:
    """Post ``body`` (``"stream": true`` is added) to ``url`` and read the stream
    to its end. ``begun`` is released once: at its first chunk, or when it ends
    without one (so whoever waits for streams to begin is not left waiting)."""
    pieces, finish, done, error = 0, None, False, None
    headers = {"Authorization": f"Bearer {key}"}
    try:
        with requests.post(url, json={**body, "stream": True}, headers=headers, stream=True, timeout=timeout_s) as r:
            if r.status_code != 200:
                error = f"{r.status_code}: {r.text[:300]}"
            for line in r.iter_lines(decode_unicode=True) if r.status_code == 200 else []:
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = str(chunk["error"])[:300]
                    continue
                for choice in chunk["choices"]:
                    pieces += 1
                    if pieces == 1 and begun is not None:
                        begun.release()
                    finish = choice.get("finish_reason") or finish
    except requests.RequestException as exc:
        error = repr(exc)[:300]
    if pieces == 0 and begun is not None:
        begun.release()
    return StreamEnd(pieces=pieces, finish_reason=finish, done=done, error=error, ended=time.monotonic())
