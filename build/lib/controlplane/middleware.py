"""Middleware of Gantry's own.

WhiteNoise's middleware is sync-only. One sync middleware makes Django run the
whole chain in a worker thread and wrap every async view (the streamed
generate action, the gateway) in async_to_sync, which costs milliseconds per
request and a thread per stream. ``StaticFiles`` is WhiteNoise with an async
path: a static file is still served by WhiteNoise, everything else goes on to
the next middleware in the caller's mode.
"""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponseBase
from whitenoise.middleware import WhiteNoiseMiddleware


class StaticFiles(WhiteNoiseMiddleware):
    sync_capable = True
    async_capable = True

    def __init__(self, get_response, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        super().__init__(get_response, *args, **kwargs)
        self._async = iscoroutinefunction(get_response)
        if self._async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest):  # noqa: ANN204 - a response, or a coroutine of one
        if self._async:
            return self._acall(request)
        return super().__call__(request)

    async def _acall(self, request: HttpRequest) -> HttpResponseBase:
        static_file = self.find_file(request.path_info) if self.autorefresh else self.files.get(request.path_info)
        if static_file is not None:
            return self.serve(static_file, request)
        return await self.get_response(request)
