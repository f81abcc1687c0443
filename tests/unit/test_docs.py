"""The manual cannot drift from the code: every variable the settings read is
in docs/configuration.md and every one listed there is read somewhere; the
README stays short and its links lead to pages that exist. (make docs builds
the site with broken links failing it.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGURATION = ROOT / "docs" / "configuration.md"


def _listed() -> set[str]:
    """Every variable named in the first column of the configuration tables."""
    cells = re.findall(r"^\| ([^|]+) \|", CONFIGURATION.read_text(), flags=re.MULTILINE)
    return {name for cell in cells for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", cell)}


def _read_by_settings() -> set[str]:
    return set(re.findall(r'env_\w+\(\s*"([A-Z][A-Z0-9_]+)"', (ROOT / "controlplane" / "settings.py").read_text()))


def test_every_setting_is_documented_and_every_documented_variable_is_read():
    listed = _listed()
    assert _read_by_settings() - listed == set(), "read by controlplane/settings.py, missing from the manual"
    code = "\n".join(
        path.read_text(errors="replace")
        for pattern in ("**/*.py", "**/*.sh", "Makefile", "*.yml")
        for path in ROOT.glob(pattern)
        if not any(part.startswith(".") or part in ("node_modules", "var") for part in path.relative_to(ROOT).parts)
        and path.resolve() != Path(__file__).resolve()
    )
    stale = {name for name in listed if name not in code}
    assert stale == set(), "listed in the manual but read nowhere"


def test_the_readme_is_short_and_its_links_lead_somewhere():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert links, "the README links to the manual"
    missing = [link for link in links if not link.startswith("http") and not (ROOT / link).exists()]
    assert missing == []


def test_every_code_block_is_run_by_the_recipe_test_or_says_why_not():
    from tests.recipes import LANGUAGES, all_blocks

    found = all_blocks()
    unknown = [b.where for b in found if b.language not in (*LANGUAGES, "text", "yaml", "json", "ini", "console")]
    assert unknown == [], "a block in a language the recipe test cannot run: make it sh or python, or text"
    runnable = [b for b in found if b.language in LANGUAGES and not b.not_run]
    assert len(runnable) >= 6, [b.where for b in runnable]
    vague = [b.where for b in found if b.not_run and len(b.not_run) < 20]
    assert vague == [], "a block that is not run says why, in words"


def test_the_generated_pages_match_the_settings_and_the_schema():
    """docs/configuration.md's table and docs/api-reference.md are what
    `manage.py gantry_docs` writes from the code now."""
    from controlplane.docs import generated, settings_variables

    declared = settings_variables()
    assert len(declared) >= 40 and all(len(v.help) > 10 for v in declared), "every setting says what it means"
    stale = [path.name for path, text in generated().items() if path.read_text() != text]
    assert stale == [], "run DATABASE_URL=postgres://... python manage.py gantry_docs and commit the pages"
