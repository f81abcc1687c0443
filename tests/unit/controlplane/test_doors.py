"""Which door of the web server answers a Django request (controlplane.asgi)."""

from __future__ import annotations

import pytest

from controlplane.asgi import _async_view


@pytest.mark.parametrize(
    ("path", "root_path", "async_"),
    [
        ("/api/deployments/7/generate/", "", True),  # the streamed generate action
        ("/gantry/api/deployments/7/generate/", "/gantry", True),  # behind a proxy's prefix
        ("/api/builds/", "", False),
        ("/api/deployments/7/", "", False),
        ("/deployments/7/", "", False),
        ("/admin/", "", False),
        ("/no/such/page/", "", False),  # Django's 404, by the sync door
    ],
)
def test_only_async_views_take_the_asgi_door(path: str, root_path: str, async_: bool) -> None:
    assert _async_view({"path": path, "root_path": root_path}) is async_
