"""tests/ and benchmarks/ meet in one direction only (issue 42): a benchmark imports the cases, damage
generators and fault harnesses it runs from tests/ (`from tests.faults import corruptions`, as
benchmarks/real_bugs.py imports tests/real_bugs/), and nothing under tests/ imports a benchmark module
or reaches benchmarks/ through the import path. A test that checks a benchmark's figures reads its
results files (benchmarks/results/), which is not an import.

An AST walk over every module under tests/. Flagged:
- an import of `benchmarks` or of a module named like a file of benchmarks/ (`import robustness`);
- an import path or a file loader aimed at benchmarks/: `sys.path` changed, `site.addsitedir`,
  `importlib.util.spec_from_file_location`, `importlib.machinery.SourceFileLoader`, `runpy.run_path`,
  `importlib.import_module`, or a `PYTHONPATH` handed to a child, whose arguments name benchmarks
  (directly or through a module-level name bound to an expression that does).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARK_MODULES = frozenset({"benchmarks", *(path.stem for path in (ROOT / "benchmarks").glob("*.py"))})
LOADERS = frozenset({"spec_from_file_location", "SourceFileLoader", "run_path", "addsitedir", "import_module"})
"""Calls that load code from a path or a name given at run time."""
PATH_EDITS = frozenset({"insert", "append", "extend", "__setitem__", "__iadd__"})


def _source(node: ast.AST, text: str) -> str:
    return ast.get_source_segment(text, node) or ""


def _bindings(tree: ast.Module, text: str) -> dict[str, str]:
    """Module-level name -> the source of the expression bound to it (`BENCH = ROOT / "benchmarks"`)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = _source(node.value, text)
    return found


def _names_benchmarks(node: ast.AST, text: str, bindings: dict[str, str]) -> bool:
    if "benchmarks" in _source(node, text):
        return True
    return any(isinstance(name, ast.Name) and "benchmarks" in bindings.get(name.id, "") for name in ast.walk(node))


def _is_sys_path(node: ast.AST) -> bool:
    """`sys.path`, or a subscript of it (`sys.path[:0]`)."""
    if isinstance(node, ast.Subscript):
        node = node.value
    return isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
        and node.value.id == "sys"


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def problems_in(text: str, where: str) -> list[str]:
    """Every place in one module's source where it reaches into benchmarks/, as "file:line: what"."""
    tree = ast.parse(text)
    bindings = _bindings(tree, text)
    found = []
    for node in ast.walk(tree):
        line = f"{where}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{line}: imports {alias.name}" for alias in node.names
                      if alias.name.split(".")[0] in BENCHMARK_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in BENCHMARK_MODULES:
            found.append(f"{line}: imports from {node.module}")
        elif isinstance(node, ast.Call):
            name = _callee(node)
            edits_path = name in PATH_EDITS and isinstance(node.func, ast.Attribute) and _is_sys_path(node.func.value)
            if (edits_path or name in LOADERS) and any(_names_benchmarks(arg, text, bindings) for arg in node.args):
                found.append(f"{line}: {_source(node, text)[:120]}")
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_is_sys_path(target) for target in targets) and _names_benchmarks(node.value, text, bindings):
                found.append(f"{line}: {_source(node, text)[:120]}")
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "PYTHONPATH" \
                        and _names_benchmarks(value, text, bindings):
                    found.append(f"{line}: PYTHONPATH {_source(value, text)[:120]}")
    return found


def test_nothing_under_tests_reaches_into_benchmarks():
    modules = sorted(path for path in (ROOT / "tests").rglob("*.py") if "__pycache__" not in path.parts)
    assert len(modules) > 50, "the walk found too few test modules"
    found = [problem for path in modules
             for problem in problems_in(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == [], "tests/ must not import from benchmarks/ (move the code into tests/, e.g. tests/faults/):\n" \
        + "\n".join(found)


PLANTED = {
    "sys.path.insert": 'import sys\nsys.path.insert(0, str(ROOT / "benchmarks"))\n',
    "sys.path.append through a name": 'import sys\nBENCH = ROOT / "benchmarks"\nsys.path.append(str(BENCH))\n',
    "sys.path slice assignment": 'import sys\nsys.path[:0] = [str(ROOT / "benchmarks")]\n',
    "import of a benchmark module": "import robustness\n",
    "from-import of a benchmark module": "from index_open import write_run\n",
    "import of the benchmarks package": "from benchmarks.robustness import catalogue\n",
    "file loader": 'import importlib.util\nspec = importlib.util.spec_from_file_location("b", ROOT / "benchmarks" / "scale.py")\n',
    "runpy": 'import runpy\nrunpy.run_path("benchmarks/replay.py")\n',
    "PYTHONPATH of a child": 'env = {"PYTHONPATH": str(ROOT / "benchmarks")}\n',
}


@pytest.mark.parametrize("source", list(PLANTED.values()), ids=list(PLANTED))
def test_a_planted_reach_into_benchmarks_is_found(source):
    assert len(problems_in(source, "planted.py")) == 1, problems_in(source, "planted.py")


ALLOWED = {
    "the package of fault harnesses": "from tests.faults import corruptions\nfrom tests.faults.meta_rows import write_meta\n",
    "a relative import named like a benchmark": "from .robustness import x\n",
    "a results file read": 'text = (ROOT / "benchmarks" / "results" / "robustness.md").read_text()\n',
    "another directory on sys.path": 'import sys\nsys.path.insert(0, str(ROOT / "tests" / "golden"))\n',
    "the checkout on a child's PYTHONPATH": 'env = {"PYTHONPATH": str(ROOT)}\n',
}


@pytest.mark.parametrize("source", list(ALLOWED.values()), ids=list(ALLOWED))
def test_what_is_not_a_reach_into_benchmarks_passes(source):
    assert problems_in(source, "allowed.py") == []
