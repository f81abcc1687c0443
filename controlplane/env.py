"""Typed environment variables that fail loudly on bad values.

Every variable Gantry reads goes through these helpers, so a typo in a
deployment's environment stops the process at start-up with the variable's
name and the rule it broke, instead of surfacing later as odd behaviour.
A secret may also be given as ``<NAME>_FILE`` pointing at a file that holds it.

Each helper also declares its variable (``help``: what it means; ``shown``:
the default in words where the value in code is not what a reader wants), so
docs/configuration.md's table is generated from the settings and cannot
drift (``python manage.py gantry_docs``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class Variable:
    name: str
    default: str  # as a reader would write it
    values: str  # what it accepts
    help: str


DECLARED: dict[str, Variable] = {}


def _declare(name: str, default: Any, values: str, help: str, shown: str | None) -> None:
    if shown is None:
        if default is None:
            shown = "required"
        elif isinstance(default, bool):
            shown = "`1`" if default else "`0`"
        elif isinstance(default, (list, tuple)) and not default or default in ("", {}):
            shown = "empty"
        elif isinstance(default, list):
            shown = f"`{','.join(str(item) for item in default)}`"
        else:
            shown = f"`{default}`"
    DECLARED[name] = Variable(name=name, default=shown, values=values, help=help)


def _bounds(minimum: float | None, maximum: float | None) -> str:
    if minimum is not None and maximum is not None:
        return f"{minimum} to {maximum}"
    if minimum is not None:
        return f"at least {minimum}"
    return f"at most {maximum}" if maximum is not None else ""


def _raw(name: str) -> str | None:
    file_name = os.environ.get(f"{name}_FILE")
    if file_name:
        try:
            return Path(file_name).read_text().strip()
        except OSError as exc:
            raise ImproperlyConfigured(f"{name}_FILE: cannot read {file_name}: {exc}") from exc
    return os.environ.get(name)


def env_str(name: str, default: str | None = None, *, help: str = "", shown: str | None = None) -> str:
    _declare(name, default, "text", help, shown)
    value = _raw(name)
    if value is None:
        if default is None:
            raise ImproperlyConfigured(f"{name} is required and not set")
        return default
    return value


def env_bool(name: str, default: bool, *, help: str = "", shown: str | None = None) -> bool:
    _declare(name, default, "1/0, true/false, yes/no, on/off", help, shown)
    value = _raw(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={value!r}: must be one of 1/0, true/false, yes/no, on/off")


def env_int(
    name: str,
    default: int,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    help: str = "",
    shown: str | None = None,
) -> int:
    _declare(name, default, " ".join(filter(None, ["integer", _bounds(minimum, maximum)])), help, shown)
    value = _raw(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}={value!r}: must be an integer") from exc
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name}={number}: must be >= {minimum}")
    if maximum is not None and number > maximum:
        raise ImproperlyConfigured(f"{name}={number}: must be <= {maximum}")
    return number


def env_float(
    name: str,
    default: float,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    help: str = "",
    shown: str | None = None,
) -> float:
    _declare(name, default, " ".join(filter(None, ["number", _bounds(minimum, maximum)])), help, shown)
    value = _raw(name)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}={value!r}: must be a number") from exc
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name}={number}: must be >= {minimum}")
    if maximum is not None and number > maximum:
        raise ImproperlyConfigured(f"{name}={number}: must be <= {maximum}")
    return number


def env_list(name: str, default: list[str], *, help: str = "", shown: str | None = None) -> list[str]:
    _declare(name, default, "comma-separated", help, shown)
    value = _raw(name)
    if value is None:
        return default
    return [item.strip() for item in value.split(",") if item.strip()]


def env_port_range(name: str, default: tuple[int, int], *, help: str = "") -> tuple[int, int]:
    _declare(name, default, "`LOW-HIGH`, 1024-65535, at least 3 ports", help, f"`{default[0]}-{default[1]}`")
    value = _raw(name)
    if value is None:
        return default
    try:
        low_text, high_text = value.split("-", 1)
        low, high = int(low_text), int(high_text)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}={value!r}: must look like 18000-18999") from exc
    if not (1024 <= low < high <= 65535) or high - low < 2:
        raise ImproperlyConfigured(f"{name}={value!r}: needs 1024 <= low < high <= 65535 and room for 3 ports")
    return low, high


def env_ulimits(name: str, default: list[tuple[str, int, int]], *, help: str = "") -> list[tuple[str, int, int]]:
    """ "memlock=-1:-1,stack=67108864:67108864" -> [(name, soft, hard), ...]; empty for none."""
    shown = f"`{','.join(f'{limit}={soft}:{hard}' for limit, soft, hard in default)}`"
    _declare(name, default, "`name=soft:hard`, comma-separated", help, shown)
    value = _raw(name)
    if value is None:
        return default
    limits = []
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        try:
            limit, numbers = item.split("=", 1)
            soft, hard = (int(n) for n in numbers.split(":", 1))
        except ValueError as exc:
            raise ImproperlyConfigured(f"{name}: {item!r} must look like memlock=-1:-1") from exc
        if not limit.isalpha():
            raise ImproperlyConfigured(f"{name}: {limit!r} is not a ulimit name")
        limits.append((limit, soft, hard))
    return limits


def env_image_versions(name: str, default: dict[str, str], *, help: str = "") -> dict[str, str]:
    """ "repo/name:tag=0.16.0,other:tag=0.20.0" -> {image: TensorRT-LLM version}."""
    _declare(name, default, "`image=TensorRT-LLM version`, comma-separated", help, None)
    value = _raw(name)
    if value is None:
        return default
    images = {}
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        image, sep, version = item.rpartition("=")
        if not sep or not image or not re.fullmatch(r"\d+\.\d+\.\d+(\.\w+)?", version):
            raise ImproperlyConfigured(
                f"{name}: {item!r} must look like repo/name:tag=0.16.0 (image=TensorRT-LLM version)"
            )
        images[image] = version
    return images


def registry_credentials(text: str) -> dict[str, dict[str, str]]:
    """GANTRY_REGISTRY_CREDENTIALS read: registry -> {"username", "password"}; a
    setting that breaks the shape fails loudly, naming the rule (never the secret)."""
    if not text.strip():
        return {}
    rule = 'must be a JSON object {"<registry>": {"username": "...", "password": "..."}}'
    try:
        found = json.loads(text)
    except ValueError:
        raise ImproperlyConfigured(f"GANTRY_REGISTRY_CREDENTIALS {rule}: it is not JSON") from None
    if not isinstance(found, dict) or not all(
        isinstance(k, str)
        and k
        and isinstance(v, dict)
        and set(v) == {"username", "password"}
        and all(isinstance(x, str) and x for x in v.values())
        for k, v in found.items()
    ):
        raise ImproperlyConfigured(f"GANTRY_REGISTRY_CREDENTIALS {rule}")
    return found
