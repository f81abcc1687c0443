"""One version, pyproject.toml's, wherever Gantry shows it."""

from __future__ import annotations

from pathlib import Path

from common.version import gantry_version

ROOT = Path(__file__).resolve().parents[3]


def test_the_pages_and_the_api_schema_show_pyprojects_version(client, operator):
    assert f'version = "{gantry_version()}"' in (ROOT / "pyproject.toml").read_text()
    page = client.get("/login/")
    assert f'<footer class="site-footer">Gantry {gantry_version()}</footer>' in page.content.decode()
    client.force_login(operator)
    schema = client.get("/api/schema/?format=json")
    assert schema.json()["info"]["version"] == gantry_version()


def test_the_changelog_names_the_current_release():
    assert f"## {gantry_version()}" in (ROOT / "CHANGELOG.md").read_text()
