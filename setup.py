"""The wheel carries the pages' templates and static files, the manual's
examples and the host's install scripts as package data (controlplane.paths
finds them): pip installs nothing beside the packages, and a checkout keeps
them at its top level (DESIGN.md). Everything else is in pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# shipped/<folder> <- the checkout's files (globs relative to the checkout).
SHIPPED = {
    "templates": ["templates/**/*.html"],
    "static": ["static/*.js", "static/*.css", "static/*.ico", "static/*.svg", "static/vendor/*"],
    "examples": ["docs/prometheus.yml", "docs/grafana/*.json"],
    "tools": ["scripts/ensure-aiperf.sh", "aiperf.lock"],
}
# Drawn by the pages; installed by `make frontend` (npm, pinned by package-lock.json).
REQUIRED = ["static/vendor/uPlot.iife.min.js", "static/vendor/uPlot.min.css"]


class BuildWithSite(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads the checkout itself
            return
        missing = [name for name in REQUIRED if not (ROOT / name).is_file()]
        if missing:
            raise SystemExit(f"{', '.join(missing)} missing: run `make frontend` (npm) before building the wheel")
        for folder, patterns in SHIPPED.items():
            for pattern in patterns:
                for source in sorted(ROOT.glob(pattern)):
                    if not source.is_file() or source.name.startswith("."):
                        continue
                    relative = source.relative_to(ROOT)
                    if folder in ("templates", "static"):  # the folder itself is the shipped one
                        relative = relative.relative_to(folder)
                    elif folder == "examples":
                        relative = relative.relative_to("docs")
                    target = Path(self.build_lib) / "controlplane" / "shipped" / folder / relative
                    self.mkpath(str(target.parent))
                    self.copy_file(str(source), str(target), preserve_mode=True)


setup(cmdclass={"build_py": BuildWithSite})
