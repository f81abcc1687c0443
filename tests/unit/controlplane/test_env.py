"""Typed environment variables: bad values fail loudly, naming the variable."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from controlplane.env import env_bool, env_int, env_port_range, env_str, env_ulimits, registry_credentials


def test_bad_boolean_names_the_variable(monkeypatch):
    monkeypatch.setenv("GANTRY_X", "maybe")
    with pytest.raises(ImproperlyConfigured, match="GANTRY_X='maybe'"):
        env_bool("GANTRY_X", False)


def test_integer_bounds(monkeypatch):
    monkeypatch.setenv("GANTRY_X", "0")
    with pytest.raises(ImproperlyConfigured, match="must be >= 1"):
        env_int("GANTRY_X", 5, minimum=1)


def test_secret_from_file(monkeypatch, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    monkeypatch.setenv("GANTRY_X_FILE", str(secret))
    assert env_str("GANTRY_X") == "s3cret"


def test_required_variable_missing(monkeypatch):
    monkeypatch.delenv("GANTRY_X", raising=False)
    with pytest.raises(ImproperlyConfigured, match="GANTRY_X is required"):
        env_str("GANTRY_X")


def test_port_range(monkeypatch):
    monkeypatch.setenv("GANTRY_X", "18000-18002")
    assert env_port_range("GANTRY_X", (1, 2)) == (18000, 18002)
    monkeypatch.setenv("GANTRY_X", "9000")
    with pytest.raises(ImproperlyConfigured, match="18000-18999"):
        env_port_range("GANTRY_X", (1, 2))


def test_ulimits(monkeypatch):
    monkeypatch.setenv("GANTRY_X", "memlock=-1:-1, stack=67108864:67108864")
    assert env_ulimits("GANTRY_X", []) == [("memlock", -1, -1), ("stack", 67108864, 67108864)]
    monkeypatch.setenv("GANTRY_X", "memlock=lots")
    with pytest.raises(ImproperlyConfigured, match="must look like memlock=-1:-1"):
        env_ulimits("GANTRY_X", [])


def test_registry_credentials_are_read_by_registry_and_a_bad_shape_names_the_rule_never_the_secret():
    good = '{"127.0.0.1:5000": {"username": "host", "password": "s3cret"}}'
    assert registry_credentials(good) == {"127.0.0.1:5000": {"username": "host", "password": "s3cret"}}
    assert registry_credentials("") == {}
    for bad in ("not json", '["x"]', '{"r": {"username": "host"}}', '{"r": {"username": "", "password": "s3cret"}}',
                '{"r": {"username": "u", "password": "s3cret", "email": "e"}}'):  # fmt: skip
        with pytest.raises(ImproperlyConfigured, match="GANTRY_REGISTRY_CREDENTIALS must be a JSON object") as refused:
            registry_credentials(bad)
        assert "s3cret" not in str(refused.value)
