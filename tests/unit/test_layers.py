"""The layers point one way: shared < core < the domain apps, each on a floor
of its own < doors < project (README, "Architecture"). A module may import its
own floor or one below, so two domain apps never import each other; a door
(an app's API, pages, tasks, ...) may use any domain app. The host side
(workers) reaches the web side only through tasks and the database, and the
web side runs no host code. This walks every import of Gantry's own code and
fails on one that runs back up."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SHARED, CORE = 0, 1
# The domain apps, lowest first: each may import those before it, never one after it.
DOMAIN_APPS = ("hosts", "deployments", "access", "inference", "gateway", "loadtests")
DOORS = CORE + len(DOMAIN_APPS) + 1
PROJECT = DOORS + 1
# The floor of each package; a door module inside a domain app is named by its
# part of the path (api, web, views, ...), see _layer.
PACKAGES = {
    "common": SHARED,
    "triton_server": SHARED,
    "upstream": SHARED,
    "core": CORE,
    **{app: CORE + 1 + rank for rank, app in enumerate(DOMAIN_APPS)},
    "workers": DOORS,
    "controlplane": PROJECT,
}
DOOR_PARTS = {
    "api",
    "web",
    "web_urls",
    "schemas",
    "views",
    "consumers",
    "routing",
    "ws_auth",
    "urls",
    "admin",
    "admin_site",
    "app",
    "tasks",
    "management",
    "context",
    "lean",
    "endpoints",
}
# The host side may use the domain of deployments and load tests, never a web app.
HOST_MAY_NOT = ("gateway", "access", "inference")


def _layer(module: str) -> int:
    parts = module.split(".")
    layer = PACKAGES[parts[0]]
    if parts[0] in DOMAIN_APPS and DOOR_PARTS & set(parts[1:]):
        return DOORS
    return layer


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" not in path.parts:
                found[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    return found


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return [name for name in names if name.split(".")[0] in PACKAGES]


def _target(name: str, modules: dict[str, Path]) -> str:
    """The module an imported name lives in (``from a.b import c`` may name a module or a name in one)."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _edges() -> list[tuple[str, str]]:
    modules = _modules()
    return sorted({(m, _target(name, modules)) for m, path in modules.items() for name in _imports(path)})


def back_up() -> list[str]:
    """Imports of a higher layer."""
    return [f"{module} -> {target}" for module, target in _edges() if _layer(target) > _layer(module)]


def host_to_web() -> list[str]:
    """Host-side imports of a web app or of another app's doors."""
    return [
        f"{module} -> {target}"
        for module, target in _edges()
        if module.startswith("workers")
        and (target.startswith(HOST_MAY_NOT) or _layer(target) == DOORS and not target.startswith("workers"))
    ]


def web_to_host() -> list[str]:
    """Imports of host-side code from the web side or the shared layer (the project wires both)."""
    return [
        f"{module} -> {target}"
        for module, target in _edges()
        if target.startswith("workers") and not module.startswith(("workers", "controlplane"))
    ]


def circles() -> list[list[str]]:
    """Modules that import one another round a circle, imports inside functions
    counted (a local import is how a circle hides): each circle once, by
    Tarjan's strongly connected components."""
    graph: dict[str, set[str]] = {}
    for module, target in _edges():
        if module != target:
            graph.setdefault(module, set()).add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph.get(module, ()):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            circle = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(circle) > 1:
                found.append(sorted(circle))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_import_runs_back_up():
    assert back_up() == []


def test_no_modules_import_each_other_round_a_circle():
    assert circles() == []


def test_the_host_side_reaches_the_web_side_only_through_tasks_and_the_database():
    assert host_to_web() == []


def test_the_web_side_imports_no_host_code():
    assert web_to_host() == []


def test_a_demo_on_sqlite_loads_every_door_without_the_postgresql_driver(tmp_path: Path):
    """Only PostgreSQL's own paths (host joins) import psycopg: the GPU suite's
    control plane runs on SQLite where the driver is not installed."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['psycopg'] = None\n"  # importing it now raises ImportError
        "import django; django.setup()\n"
        "import controlplane.urls, controlplane.asgi, workers.tasks, deployments.tasks\n"
    )
    env = {"DJANGO_SETTINGS_MODULE": "controlplane.settings", "SECRET_KEY": "x", "GANTRY_DATA_DIR": str(tmp_path),
           "PATH": "/usr/bin:/bin"}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


LONG = 450


def test_a_module_over_450_lines_says_why():
    """A long module is a place a newcomer gets lost in: one over LONG lines
    gives its reason in its docstring ("Over 450 lines on purpose: ...")."""
    long = []
    for package in (*PACKAGES, "tests"):
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" in path.parts or len(path.read_text().splitlines()) <= LONG:
                continue
            said = " ".join((ast.get_docstring(ast.parse(path.read_text())) or "").split()).lower()
            if f"over {LONG} lines on purpose" not in said:
                long.append(str(path.relative_to(ROOT)))
    assert long == []
