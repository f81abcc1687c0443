"""docker-compose.yml as a user starts it: no GPU needed, migrations first,
health checks, no database open to the network or with a default password,
an image that holds every package Gantry installs, and files docker-compose
itself accepts. (No image can be pulled here, so the files are checked, not
run: see docs/install.md.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
GANTRY = ("web", "pages", "live", "worker", "beat")


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


def test_every_app_gantry_installs_is_packaged_and_copied_into_the_image():
    """An app in INSTALLED_APPS that pyproject's package list or the Dockerfile
    leaves out breaks the image at collectstatic (loadtests did): any next app too."""
    from django.conf import settings

    ours = {app.split(".")[0] for app in settings.INSTALLED_APPS if (ROOT / app.split(".")[0]).is_dir()}
    includes = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = set(re.findall(r"^COPY (\w+) \1$", (ROOT / "Dockerfile").read_text(), flags=re.MULTILINE))
    assert ours, "no local app found in INSTALLED_APPS"
    assert ours <= {pattern.rstrip("*") for pattern in includes}, "missing from pyproject's packages"
    assert ours <= copied, "not copied into the image by the Dockerfile"


def test_every_package_of_gantrys_code_is_packaged_copied_and_in_the_build_context():
    """Not only apps: a top-level package the code imports (triton_server and
    inference were missed once) must be installed, copied and sent to Docker."""
    packages = {
        path.parent.name
        for path in ROOT.glob("*/__init__.py")
        if path.parent.name not in ("tests", "bench") and not path.parent.name.startswith(".")
    }
    includes = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = set(re.findall(r"^COPY (\w+) \1$", (ROOT / "Dockerfile").read_text(), flags=re.MULTILINE))
    sent = {line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    assert {"common", "triton_server", "inference", "workers"} <= packages
    assert packages - {pattern.rstrip("*") for pattern in includes} == set(), "missing from pyproject's packages"
    assert packages - copied == set(), "not copied into the image by the Dockerfile"
    assert packages - sent == set(), "left out of the build context by .dockerignore"


@pytest.mark.parametrize("overrides", [[], ["docker-compose.gpu.yml"], ["docker-compose.docker.yml"]])
def test_docker_compose_itself_accepts_the_files(overrides: list[str]):
    """Validated by docker-compose (Debian's, which make test installs), with the
    variables a user must set; and refused, naming them, without them."""
    binary = shutil.which("docker-compose")
    assert binary, "docker-compose is not installed (make test installs it)"
    files = [arg for name in ["docker-compose.yml", *overrides] for arg in ("-f", str(ROOT / name))]
    needed = {"POSTGRES_PASSWORD": "p", "SECRET_KEY": "s", "GANTRY_HOST_NAME": "h"}
    if "docker-compose.docker.yml" in overrides:
        needed |= {"GANTRY_DATA_DIR": "/var/lib/gantry", "GANTRY_MODELS_DIR": "/srv/models"}
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}
    checked = subprocess.run([binary, *files, "config", "-q"], env={**base, **needed}, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    bare = subprocess.run([binary, *files, "config", "-q"], env=base, capture_output=True, text=True)
    assert bare.returncode != 0 and "set POSTGRES_PASSWORD" in bare.stderr


def test_the_docker_override_hands_the_worker_the_engine_and_same_path_folders():
    override = yaml.safe_load((ROOT / "docker-compose.docker.yml").read_text())["services"]["worker"]
    assert "/var/run/docker.sock:/var/run/docker.sock" in override["volumes"]
    for variable in ("GANTRY_DATA_DIR", "GANTRY_MODELS_DIR"):
        assert any(v.startswith(f"${{{variable}}}:${{{variable}}}") for v in override["volumes"]), variable


def test_the_shipped_proxy_config_is_the_one_gantry_writes_for_composes_ports():
    """deploy/nginx.conf is `gantry proxy-config --listen 8080` for the ports the
    services listen on: written by the code that the proxy test runs, never by hand."""
    from controlplane.proxy import nginx_config

    def port(name: str) -> str:
        command = SERVICES[name]["command"]
        return command[command.index("--port") + 1]

    expected = nginx_config(
        listen="8080", web=f"127.0.0.1:{port('web')}", pages=f"127.0.0.1:{port('pages')}",
        live=f"127.0.0.1:{port('live')}",
    )  # fmt: skip
    assert (ROOT / "deploy" / "nginx.conf").read_text() == expected
    assert SERVICES["proxy"]["volumes"] == ["./deploy/nginx.conf:/etc/nginx/nginx.conf:ro"]
    assert SERVICES["proxy"]["healthcheck"]["test"][-1] == "http://127.0.0.1:8080/healthz"
