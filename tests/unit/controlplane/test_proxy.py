"""nginx's configuration for one address in front of the servers (controlplane.proxy);
tests/integration/test_proxy.py runs it in front of the real servers."""

from __future__ import annotations

import re

import pytest

from controlplane.proxy import ROUTES, nginx_config


def _locations(text: str) -> dict[str, str]:
    return dict(re.findall(r"location ([^{]+?) \{(.*?)\n        \}", text, flags=re.S))


def test_every_door_that_streams_is_unbuffered_and_websockets_are_upgraded():
    locations = _locations(nginx_config(listen="8080", pages="127.0.0.1:1", web="127.0.0.1:2", live="127.0.0.1:3"))
    assert set(locations) == {route.location for route in ROUTES}
    for streamed in ("/v1/", "~ ^/api/deployments/[0-9]+/generate/$"):
        assert "proxy_pass http://gantry_web;" in locations[streamed]
        assert "proxy_buffering off;" in locations[streamed]
    assert "proxy_set_header Upgrade $http_upgrade;" in locations["/ws/"]
    assert "proxy_pass http://gantry_live;" in locations["/ws/"]
    # Upstream connections are kept: no "Connection: close" from nginx to the servers.
    assert 'proxy_set_header Connection "";' in locations["/"]
    assert "buffering" not in locations["/"]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"pages": "localhost"}, "--pages: 'localhost' is not host:port"),
        ({"web": "127.0.0.1:http"}, "--web: '127.0.0.1:http' is not host:port"),
        ({"listen": "0.0.0.0:"}, "--listen: '0.0.0.0:' is not [address:]port"),
    ],
)
def test_an_address_that_is_not_host_and_port_is_refused_by_name(arguments, message):  # noqa: ANN001
    given = {"listen": "8080", "pages": "127.0.0.1:1", "web": "127.0.0.1:2", "live": "127.0.0.1:3", **arguments}
    with pytest.raises(ValueError, match=re.escape(message)):
        nginx_config(**given)
