"""The wheel is the product: built from this checkout, installed with its
worker extra into a virtual environment of its own, and run as `gantry demo`
from an empty folder with a new user's home, far from the source tree. Every
page then answers in Chromium with no console error and no failed request,
README's REST and OpenAI recipes run against it, and Ctrl-C leaves every row
stopped.

The environment is kept between runs under ~/.cache/gantry/ (keyed by
pyproject.toml and requirements.lock, which decide what it holds): its first
build installs torch and the rest (minutes); later runs put the new wheel in
it without its dependencies."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.integration.conftest import CHROMIUM, CHROMIUM_ARGS, free_ports, healthz_answers, wait_for
from tests.recipes import ROOT, script

pytestmark = [pytest.mark.integration]

CACHE = Path.home() / ".cache" / "gantry"
# Every page a person reaches from the menu, and one of each kind of object's.
PAGES = [
    "/", "/models/", "/models/1/", "/builds/", "/deployments/new/", "/deployments/1/", "/loadtests/", "/tuning/",
    "/events/", "/gateway/", "/tokens/", "/api/docs/", "/api/deployments/", "/admin/",
    "/admin/deployments/deployment/", "/admin/deployments/deployment/1/change/", "/admin/auth/user/",
    "/admin/access/externalidentity/",
]  # fmt: skip
SCREENSHOTS = ROOT / "docs" / "screenshots"
TABS = ["playground", "metrics-panel", "gpu-plan", "testing", "versions", "log-panel", "timeline"]


def _build_wheel(into: Path) -> Path:
    """The wheel pip builds from this checkout (the frontend's files must be there: make frontend)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(into), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    for leftover in (ROOT / "build", ROOT / "gantry.egg-info"):
        shutil.rmtree(leftover, ignore_errors=True)
    (wheel,) = into.glob("gantry-*.whl")
    return wheel


def _environment(wheel: Path) -> Path:
    """A virtual environment holding ``wheel`` with its worker extra, as a user's pip makes it."""
    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + (ROOT / "requirements.lock").read_bytes())
    venv = CACHE / f"wheel-venv-{key.hexdigest()[:12]}"
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if not (venv / ".complete").exists():
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([shutil.which("python3") or sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        subprocess.run([*pip, "-c", str(ROOT / "requirements.lock"), f"{wheel}[worker]"], check=True, timeout=1500)
        (venv / ".complete").touch()
    else:
        subprocess.run([*pip, "--no-deps", "--force-reinstall", str(wheel)], check=True, timeout=300)
    return venv


def test_the_built_wheel_run_from_an_empty_folder_serves_every_page_and_the_readme_recipes(tmp_path: Path):
    venv = _environment(_build_wheel(tmp_path / "dist"))
    gantry = venv / "bin" / "gantry"
    installed = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import controlplane; print(controlplane.__file__)"],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    ).stdout  # fmt: skip
    assert "site-packages" in installed, installed  # the wheel's code, not the checkout's

    home, folder = tmp_path / "home", tmp_path / "empty"
    home.mkdir()
    folder.mkdir()
    port = free_ports(3)  # web, live (+1), the demo's Redis (+2)
    # Its Tritons' ports reserved too: the default range (18000-) is where other tests
    # running beside this one pick theirs (seen in CI: "Socket '127.0.0.1:18001' already in use").
    triton = free_ports(30)
    env = {
        "PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "GANTRY_WEB_PORT": str(port),
        "GANTRY_TRITON_PORT_RANGE": f"{triton}-{triton + 29}",
    }
    output = tmp_path / "demo.out"
    with open(output, "wb") as out:
        demo = subprocess.Popen(
            [str(gantry), "demo"], cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    data = home / ".local" / "share" / "gantry"  # the user's data folder: never site-packages
    try:
        wait_for(lambda: "press Ctrl-C" in output.read_text() or demo.poll() is not None, 420, "the demo's summary")
        said = output.read_text()
        assert demo.poll() is None, said
        assert "Traceback" not in said and "WARNING" not in said and "W004" not in said, said
        # The URL and the password come last, set apart.
        summary = said[said.rindex("-" * 72, 0, said.rindex("-" * 72)) :]
        assert f"Gantry is running at {base}/" in summary, said
        password = re.search(r"sign in as admin with password (\S+)", summary)[1]
        assert (data / "gantry.sqlite3").is_file()
        assert not list((venv / "lib").glob("python3*/site-packages/var"))

        http = requests.Session()
        wait_for(lambda: healthz_answers(base), 60, "the web server")
        token = subprocess.run(
            [str(gantry), "token", "admin", "--name", "wheel-test"], env=env, cwd=folder,
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        http.headers["Authorization"] = f"Bearer {token}"
        stack = lambda: http.get(f"{base}/api/deployments/1/", timeout=10).json().get("shown_status")  # noqa: E731
        wait_for(lambda: stack() == "ready", 300, "demo-stack")

        _every_page_in_chromium(base, password)

        # README's recipes, as a reader runs them beside this demo: its `.venv/bin/gantry` is this wheel's.
        (folder / ".venv").symlink_to(venv)
        recipe = script(ROOT / "README.md", port, ROOT / ".venv" / "bin" / "python")  # the reader's openai client
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", recipe], cwd=folder, env=env, capture_output=True, text=True,
            timeout=400,
        )  # fmt: skip
        assert done.returncode == 0, f"{recipe}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
        assert "CompletionUsage" in done.stdout and "384" in done.stdout, done.stdout
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGINT)  # Ctrl-C
            try:
                demo.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(demo.pid, signal.SIGKILL)
                demo.wait()
        sys.stderr.write(output.read_text(errors="replace")[-4000:])
        for log in sorted((data / "logs").glob("*.log")):
            sys.stderr.write(f"\n--- {log.name}\n{log.read_text(errors='replace')[-2000:]}")
    assert demo.returncode == 0
    with sqlite3.connect(data / "gantry.sqlite3") as database:
        rows = database.execute(
            "SELECT status FROM deployments_deployment UNION SELECT status FROM deployments_replica"
        ).fetchall()
    assert set(rows) == {("stopped",)}


def _every_page_in_chromium(base: str, password: str) -> None:
    """Sign in, open every page (and each tab of a deployment's): no console error, no
    request answered 4xx or 5xx. Keeps the manual's screenshots current."""
    from playwright.sync_api import sync_playwright

    problems: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.on("console", lambda m: m.type == "error" and problems.append(f"{page.url}: console: {m.text}"))
            page.on("pageerror", lambda e: problems.append(f"{page.url}: {e}"))
            page.on(
                "response",
                lambda r: r.status >= 400 and r.url.startswith(base) and problems.append(f"{r.status} {r.url}"),
            )
            page.goto(f"{base}/login/")
            page.fill("#id_username", "admin")
            page.fill("#id_password", password)
            page.click("button[type=submit]")
            page.wait_for_url(f"{base}/")
            for path in PAGES:
                page.goto(f"{base}{path}", wait_until="networkidle")
                assert "Server Error" not in page.title(), path
            page.goto(f"{base}/deployments/1/", wait_until="networkidle")
            for tab in TABS:
                if not page.locator(f"#tab-{tab}").count():
                    continue  # a GPU plan only where the host has GPUs
                page.click(f"#tab-{tab}")
                page.wait_for_timeout(300)
                assert page.locator(f"#{tab}").is_visible(), tab
            # The manual's pictures (docs/first-deployment.md), as a new user sees the pages.
            SCREENSHOTS.mkdir(exist_ok=True)
            page.click("#tab-playground")
            page.wait_for_timeout(2500)  # a beat's live figures
            page.evaluate("window.scrollTo(0, 0)")
            page.screenshot(path=str(SCREENSHOTS / "deployment.png"))
            page.goto(f"{base}/", wait_until="networkidle")
            page.screenshot(path=str(SCREENSHOTS / "dashboard.png"))
        finally:
            browser.close()
    assert not problems, problems
