"""/hub/: the control plane's relay of hub downloads, for GPU hosts that reach
neither the hub nor a mirror (GANTRY_HUB_VIA_CONTROL_PLANE on the host).

Such a host's download asks here, in the hub's own protocol (huggingface_hub
with this address as its endpoint), with a token it signed with its channel
key for that download (``<download id>.<signature>``). The relay answers only
an active download's own host, only for its model's files at its pinned
commit, and fetches them from a host that holds them, through that host's
channel (mutual TLS, the web tier's client certificate) to its hub cache's
file server (workers.hubfiles), streaming the answer back as it comes,
ranges included (a resumed download).
"""

from __future__ import annotations

import http.client
import socket
import ssl
from collections.abc import Iterator

from django.conf import settings
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.views.decorators.http import require_http_methods

from common import pki
from common.errors import NotFound, PermissionDenied
from deployments.services import downloads
from hosts.services.channel import client_context

# The headers of the holder's answer that the downloading host reads.
PASSED = ("Content-Type", "Content-Length", "Content-Range", "Accept-Ranges", "ETag", "X-Repo-Commit",
          "X-Linked-Etag", "X-Linked-Size", "X-Error-Code", "X-Error-Message")  # fmt: skip
CHUNK = 1 << 20


class _ChannelConnection(http.client.HTTPSConnection):
    """HTTPS to a host's channel, asking it by name for one of its ports (SNI)."""

    def __init__(self, address: str, port: int, *, server_name: str, context: ssl.SSLContext) -> None:
        super().__init__(address, port, context=context, timeout=60)
        self.server_name = server_name

    def connect(self) -> None:
        raw = socket.create_connection((self.host, self.port), self.timeout)
        self.sock = self._context.wrap_socket(raw, server_hostname=self.server_name)  # type: ignore[attr-defined]


def _refused(status: int, code: str, message: str) -> HttpResponse:
    answer = HttpResponse(message, status=status, content_type="text/plain")
    answer["X-Error-Code"], answer["X-Error-Message"] = code, message
    return answer


@require_http_methods(["GET", "HEAD"])
def relay(request: HttpRequest, path: str) -> HttpResponse:
    token = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    try:
        found = downloads.relay_for(token=token)
    except PermissionDenied as exc:
        return _refused(403, "Forbidden", str(exc))
    except NotFound as exc:
        return _refused(503, "Unavailable", str(exc))
    model = found.download.model
    allowed = (f"api/models/{model.hub_id}/revision/{model.commit}", f"api/models/{model.hub_id}/tree/{model.commit}",
               f"{model.hub_id}/resolve/{model.commit}/")  # fmt: skip
    if not model.commit or not (path in allowed[:2] or path.startswith(allowed[2])):
        return _refused(404, "RevisionNotFound", f"the relay serves {model.hub_id} at commit {model.commit} only")
    holder = found.holder
    connection = _ChannelConnection(
        holder.address, holder.channel_port, context=client_context(),
        server_name=pki.server_name(holder.pk, settings.GANTRY_HUB_FILES_PORT),
    )  # fmt: skip
    query = request.META.get("QUERY_STRING", "")
    headers = {"Range": request.headers["Range"]} if "Range" in request.headers else {}
    try:
        connection.request(request.method or "GET", f"/{path}" + (f"?{query}" if query else ""), headers=headers)
        answer = connection.getresponse()
    except (OSError, http.client.HTTPException) as exc:
        connection.close()
        return _refused(503, "Unavailable", f"{holder.name}'s channel did not answer: {exc}")
    if request.method == "HEAD":
        relayed = HttpResponse(status=answer.status)
        connection.close()
    else:
        relayed = StreamingHttpResponse(_stream(connection, answer), status=answer.status)
    for name in PASSED:
        if (value := answer.getheader(name)) is not None:
            relayed[name] = value
    return relayed


def _stream(connection: http.client.HTTPSConnection, answer: http.client.HTTPResponse) -> Iterator[bytes]:
    try:
        while chunk := answer.read(CHUNK):
            yield chunk
    finally:
        connection.close()
