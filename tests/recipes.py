"""The code blocks of README.md and docs/: what a reader copies. Each ``sh`` or
``python`` block is run by tests/integration/test_docs_recipes.py as written,
unless the line before it says ``<!-- not run: <why> -->``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = ("sh", "python")
_NOT_RUN = re.compile(r"^\s*<!-- not run: (?P<why>.+?) -->\s*$")
_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<language>[a-z]*)\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    not_run: str  # why it is not run; empty when it is

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The page's fenced blocks with a language, in order."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening or not opening["language"]:
            i += 1
            continue
        indent, end = opening["indent"], i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        code = "\n".join(line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end])
        marker = _NOT_RUN.match(lines[i - 1]) if i else None
        found.append(Block(page, i + 1, opening["language"], code + "\n", marker["why"] if marker else ""))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in blocks(page)]


def script(page: Path, port: int, python: Path) -> str:
    """The page's runnable blocks as one shell script for a demo on ``port``
    (the one change made to a block); python blocks are fed to ``python``."""
    parts = []
    for block in blocks(page):
        if block.language not in LANGUAGES or block.not_run:
            continue
        code = block.code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        if block.language == "python":
            code = f"{python} - <<'GANTRY_RECIPE_PY'\n{code}GANTRY_RECIPE_PY\n"
        parts.append(f"# {block.where}\n{code}")
    return "".join(parts)
