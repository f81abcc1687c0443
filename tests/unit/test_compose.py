"""docker-compose.yml as a user starts it: no GPU needed, migrations first,
health checks, no database open to the network or with a default password,
and an image that holds every package Gantry installs. (No image can be
pulled here, so the file is checked, not run: see the README.)"""

from __future__ import annotations

import re
from pathlib import Path

import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
GANTRY = ("web", "live", "worker", "beat")


def test_the_base_file_reserves_no_gpu_and_the_override_gives_them_to_the_worker():
    assert "devices" not in (ROOT / "docker-compose.yml").read_text().replace("# ", "")
    override = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())
    devices = override["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]


def test_migrations_run_before_any_gantry_process_starts():
    assert SERVICES["migrate"]["command"][-2:] == ["migrate", "--noinput"]
    assert SERVICES["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in GANTRY:
        assert SERVICES[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully", name


def test_every_long_running_service_has_a_health_check():
    for name, service in SERVICES.items():
        if name != "migrate":
            assert service["healthcheck"]["test"][0] == "CMD", name


def test_postgres_has_no_default_password_and_listens_on_loopback_only():
    text = (ROOT / "docker-compose.yml").read_text()
    assert re.findall(r"\$\{POSTGRES_PASSWORD[^}]*\}", text) == ["${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"] * 2
    assert "listen_addresses=127.0.0.1" in SERVICES["postgres"]["command"]
    assert SERVICES["redis"]["command"][1:3] == ["--bind", "127.0.0.1"]


def test_the_image_holds_every_package_gantry_installs():
    includes = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = set(re.findall(r"^COPY (\w+) \1$", (ROOT / "Dockerfile").read_text(), flags=re.MULTILINE))
    assert {pattern.rstrip("*") for pattern in includes} <= copied
