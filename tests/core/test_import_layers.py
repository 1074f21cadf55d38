"""The stages import one way down, and nothing imports in a circle (docs/architecture.md).

An AST walk over every module of the core, the examples and the dashboard: imports inside functions
and under TYPE_CHECKING count as much as those at the top, so no edge can hide in a function body.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Where each package lives in the repository: the dashboard is app/ and pages/, installed as ttrace_dashboard.
PACKAGE_DIRS = {"ttrace_core": ROOT / "ttrace_core", "ttrace_examples": ROOT / "ttrace_examples",
                "ttrace_dashboard": ROOT / "app", "ttrace_dashboard.views": ROOT / "pages"}
# Layers from the bottom: a module may import from its own layer (no circle) or from a lower one.
# `record` and `compare` share a layer but never import each other.
LAYERS = [
    ("ttrace_core.errors",),
    ("ttrace_core.format",),
    ("ttrace_core.canonicalize",),
    ("ttrace_core.integrations",),
    ("ttrace_core.record", "ttrace_core.compare"),
    ("ttrace_core.localize",),
    ("ttrace_core.workflows",),
    ("ttrace_core.service",),
    ("ttrace_core.api",),
    ("ttrace_core.cli",),
    ("ttrace_core.__main__",),
    ("ttrace_core",),
    ("ttrace_examples", "ttrace_dashboard"),
]
FACADE_ONLY = {
    "ttrace_dashboard": ("ttrace_core", "ttrace_core.api", "ttrace_core.errors"),
    "ttrace_core.cli": ("ttrace_core.api",),
}
"""Who reaches the core through the facade only (STYLE: the terminal and the browser can never disagree), and
what of the core each may import: the dashboard also the lazy root (`from ttrace_core import api` runs it) and
the errors; the CLI nothing but `ttrace_core.api` (its own modules aside). Every exception is listed here."""


def _modules() -> dict[str, Path]:
    found = {}
    for package, directory in PACKAGE_DIRS.items():
        for path in directory.rglob("*.py"):
            if "__pycache__" in path.parts or (package == "ttrace_dashboard" and path.parent != directory):
                continue
            parts = path.relative_to(directory).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((package, *parts))] = path
    return found


MODULES = _modules()


def _owner(name: str) -> str | None:
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(name: str, path: Path) -> set[str]:
    targets = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".")[: len(name.split(".")) - (0 if is_package else 1) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            targets |= {f"{base}.{alias.name}" for alias in node.names} | {base}
    owners = {_owner(target) for target in targets}
    return {owner for owner in owners if owner and owner != name and not name.startswith(owner + ".")}


EDGES = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> tuple[int, str]:
    """(layer index, package) of a module: the longest package prefix in LAYERS that holds it."""
    matches = [(len(prefix), index, prefix) for index, layer in enumerate(LAYERS) for prefix in layer
               if name == prefix or name.startswith(prefix + ".")]
    assert matches, f"{name} is in no layer: add its package to LAYERS"
    _, index, prefix = max(matches)
    return index, prefix


def _upward_edges() -> list[str]:
    bad = []
    for source, targets in EDGES.items():
        source_layer, source_package = _layer(source)
        for target in targets:
            target_layer, target_package = _layer(target)
            if target_layer > source_layer or (target_layer == source_layer and target_package != source_package):
                bad.append(f"{source} -> {target}")
    return sorted(bad)


def _circles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, circles, counter = {}, {}, set(), [], [], 0
    for start in EDGES:
        if start in index:
            continue
        work = [(start, iter(sorted(EDGES[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(EDGES[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_every_module_is_found():
    assert {"ttrace_core.api", "ttrace_core.compare.engine", "ttrace_dashboard.ui", "ttrace_dashboard.views.heatmap",
            "ttrace_examples.commands"} <= MODULES.keys()
    assert "ttrace_core.format.reader" in EDGES["ttrace_core.compare.engine"]


def test_no_stage_imports_a_later_one():
    assert _upward_edges() == []


def test_no_modules_import_each_other_in_a_circle():
    assert _circles() == []


def _past_the_facade(user: str) -> list[str]:
    """Edges from the package `user` to any part of the core that FACADE_ONLY does not give it."""
    return sorted(f"{source} -> {target}" for source, targets in EDGES.items()
                  if source == user or source.startswith(user + ".")
                  for target in targets if target.startswith("ttrace_core") and not target.startswith(user + ".")
                  and target not in FACADE_ONLY[user])


@pytest.mark.parametrize("user", sorted(FACADE_ONLY))
def test_the_dashboard_and_the_cli_reach_the_core_only_through_the_api(user):
    assert _past_the_facade(user) == []


@pytest.mark.parametrize("source, target", [
    ("ttrace_core.cli.main", "ttrace_core.service.jobs"), ("ttrace_core.cli.report", "ttrace_core.format.reader"),
    ("ttrace_dashboard.ui", "ttrace_core.service.runs"),
], ids=["cli-to-service", "cli-to-format", "dashboard-to-service"])
def test_the_check_sees_an_edge_past_the_facade(monkeypatch, source, target):
    monkeypatch.setitem(globals(), "EDGES", {**EDGES, source: EDGES[source] | {target}})
    assert _past_the_facade(source.split(".")[0] if source.startswith("ttrace_dashboard") else "ttrace_core.cli") == \
        [f"{source} -> {target}"]


@pytest.mark.parametrize("edges, expected", [
    ({"ttrace_core.format.schema": {"ttrace_core.compare.results"}}, ["ttrace_core.format.schema -> ttrace_core.compare.results"]),
    ({"ttrace_core.compare.engine": {"ttrace_core.record.tracer"}}, ["ttrace_core.compare.engine -> ttrace_core.record.tracer"]),
    ({"ttrace_core.cli.main": {"ttrace_dashboard.report"}}, ["ttrace_core.cli.main -> ttrace_dashboard.report"]),
], ids=["format-to-compare", "compare-to-record", "core-to-dashboard"])
def test_the_check_sees_an_upward_edge(monkeypatch, edges, expected):
    monkeypatch.setitem(globals(), "EDGES", {**EDGES, **edges})
    assert _upward_edges() == expected


def test_the_check_sees_a_circle(monkeypatch):
    monkeypatch.setitem(globals(), "EDGES", {**EDGES, "ttrace_core.format.naming": {"ttrace_core.format.schema"},
                                             "ttrace_core.format.schema": {"ttrace_core.format.naming"}})
    assert ["ttrace_core.format.naming", "ttrace_core.format.schema"] in _circles()


def test_a_function_local_import_counts(tmp_path):
    path = tmp_path / "module.py"
    path.write_text("def later():\n    from ttrace_core.service.jobs import Job\n    return Job\n")
    assert _imports("ttrace_core.format.example", path) == {"ttrace_core.service.jobs"}


def test_the_wheel_lists_every_package_under_its_installed_name():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    in_tree = set()
    for package, directory in PACKAGE_DIRS.items():
        for init in directory.rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                in_tree.add(".".join((package, *init.parent.relative_to(directory).parts)))
    assert set(config["packages"]) == in_tree
    assert config["package-dir"] == {"ttrace_dashboard": "app", "ttrace_dashboard.views": "pages"}
