"""tests/ and benchmarks/ do not import each other (issue 42). A benchmark that needs a fault harness or
a data generator of tests/ runs it as a child process (`python -m tests.faults.replay_faults ...`
from the repository root, through benchmarks/harness.py) and reads the JSON it writes; a test that
checks a benchmark's figures reads its results files (benchmarks/results/). Neither is an import.

An AST walk over every module under tests/ (must not reach benchmarks/) and under benchmarks/ (must not
reach tests/). Flagged:
- an import of the other tree's package or of a module named like one of its files or packages
  (`import robustness` from tests/, `import corruptions` from benchmarks/); a name both trees use
  (replay_faults) is a module of the importer's own tree, and is allowed;
- an import path or a file loader aimed at the other tree: `sys.path` changed, `site.addsitedir`,
  `importlib.util.spec_from_file_location`, `importlib.machinery.SourceFileLoader`, `runpy.run_path`,
  `runpy.run_module`, `importlib.import_module`, `__import__`, or a `PYTHONPATH` handed to a child
  (a dict key, a keyword or an item assignment), whose arguments name the other tree (directly or
  through a module-level name bound to an expression that does).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module_names(tree: str) -> frozenset[str]:
    """The tree's package and every module or package name in it: what `import NAME` would find with a
    directory of the tree on sys.path."""
    paths = [path for path in (ROOT / tree).rglob("*") if "__pycache__" not in path.parts]
    return frozenset({tree, *(path.stem for path in paths if path.suffix == ".py"),
                      *(path.name for path in paths if path.is_dir())})


BENCHMARK_MODULES = _module_names("benchmarks")
TEST_MODULES = _module_names("tests") - BENCHMARK_MODULES - {"__init__"}
"""Names a benchmark must not import; a name both trees use resolves to benchmarks/ there."""
FORBIDDEN = {"benchmarks": BENCHMARK_MODULES, "tests": TEST_MODULES | {"tests"}}
"""The other tree -> the module names that reach it."""
LOADERS = frozenset({"spec_from_file_location", "SourceFileLoader", "run_path", "run_module", "addsitedir",
                     "import_module", "__import__"})
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


def _names(other: str, node: ast.AST, text: str, bindings: dict[str, str]) -> bool:
    """The expression names the other tree, itself or through a module-level name."""
    if other in _source(node, text):
        return True
    return any(isinstance(name, ast.Name) and other in bindings.get(name.id, "") for name in ast.walk(node))


def _is_pythonpath(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value == "PYTHONPATH"


def _is_sys_path(node: ast.AST) -> bool:
    """`sys.path`, or a subscript of it (`sys.path[:0]`)."""
    if isinstance(node, ast.Subscript):
        node = node.value
    return isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
        and node.value.id == "sys"


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def problems_in(text: str, where: str, other: str = "benchmarks") -> list[str]:
    """Every place in one module's source where it reaches into the `other` tree ("benchmarks" for a module
    of tests/, "tests" for one of benchmarks/), as "file:line: what"."""
    tree = ast.parse(text)
    bindings = _bindings(tree, text)
    forbidden = FORBIDDEN[other]
    found = []
    for node in ast.walk(tree):
        line = f"{where}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{line}: imports {alias.name}" for alias in node.names if alias.name.split(".")[0] in forbidden]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in forbidden:
            found.append(f"{line}: imports from {node.module}")
        elif isinstance(node, ast.Call):
            name = _callee(node)
            edits_path = name in PATH_EDITS and isinstance(node.func, ast.Attribute) and _is_sys_path(node.func.value)
            if (edits_path or name in LOADERS) and any(_names(other, arg, text, bindings) for arg in node.args):
                found.append(f"{line}: {_source(node, text)[:120]}")
            found += [f"{line}: PYTHONPATH {_source(keyword.value, text)[:120]}" for keyword in node.keywords
                      if keyword.arg == "PYTHONPATH" and _names(other, keyword.value, text, bindings)]
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if not _names(other, node.value, text, bindings):
                continue
            if any(_is_sys_path(target) for target in targets):
                found.append(f"{line}: {_source(node, text)[:120]}")
            elif any(isinstance(target, ast.Subscript) and _is_pythonpath(target.slice) for target in targets):
                found.append(f"{line}: PYTHONPATH {_source(node.value, text)[:120]}")
        elif isinstance(node, ast.Dict):
            found += [f"{line}: PYTHONPATH {_source(value, text)[:120]}" for key, value in zip(node.keys, node.values)
                      if _is_pythonpath(key) and _names(other, value, text, bindings)]
    return found


def _walk(tree: str, other: str) -> list[str]:
    modules = sorted(path for path in (ROOT / tree).rglob("*.py") if "__pycache__" not in path.parts)
    assert len(modules) > 20, f"the walk found too few modules under {tree}/"
    return [problem for path in modules for problem in problems_in(path.read_text(), str(path.relative_to(ROOT)), other)]


def test_nothing_under_tests_reaches_into_benchmarks():
    found = _walk("tests", "benchmarks")
    assert found == [], "tests/ must not import from benchmarks/ (move the code into tests/, e.g. tests/faults/):\n" \
        + "\n".join(found)


def test_nothing_under_benchmarks_reaches_into_tests():
    found = _walk("benchmarks", "tests")
    assert found == [], "benchmarks/ must not import from tests/ (run the harness as a child process, through " \
        "benchmarks/harness.py):\n" + "\n".join(found)


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
    "PYTHONPATH as a keyword": 'env = dict(os.environ, PYTHONPATH=str(ROOT / "benchmarks"))\n',
    "PYTHONPATH item assigned": 'env["PYTHONPATH"] = str(ROOT / "benchmarks")\n',
    "runpy.run_module": 'import runpy\nrunpy.run_module("benchmarks.replay")\n',
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


PLANTED_IN_BENCHMARKS = {
    "sys.path.insert of the checkout, then an import of tests":
        'import sys\nsys.path.insert(0, str(ROOT))\nfrom tests.faults import rank_faults\n',
    "sys.path.insert of a test directory": 'import sys\nsys.path.insert(0, str(ROOT / "tests" / "faults"))\n',
    "sys.path slice assignment through a name": 'import sys\nFAULTS = ROOT / "tests" / "faults"\nsys.path[:0] = [str(FAULTS)]\n',
    "import of the tests package": "import tests.faults.corruptions\n",
    "import of a harness by its own name": "import corruptions\n",
    "from-import of a generator by its own name": "from meta_rows import write_legacy_copy\n",
    "importlib.import_module": 'import importlib\nimportlib.import_module("tests.real_bugs.megatron_cases")\n',
    "file loader": 'import importlib.util\nspec = importlib.util.spec_from_file_location("r", ROOT / "tests" / "real_bugs" / "runner.py")\n',
    "runpy.run_module": 'import runpy\nrunpy.run_module("tests.faults.damage_runner")\n',
    "PYTHONPATH of a child": 'env = {"PYTHONPATH": str(ROOT / "tests")}\n',
    "PYTHONPATH item assigned": 'os.environ["PYTHONPATH"] = str(ROOT / "tests" / "support")\n',
}


@pytest.mark.parametrize("source", list(PLANTED_IN_BENCHMARKS.values()), ids=list(PLANTED_IN_BENCHMARKS))
def test_a_planted_reach_into_tests_is_found(source):
    assert len(problems_in(source, "planted.py", "tests")) == 1, problems_in(source, "planted.py", "tests")


ALLOWED_IN_BENCHMARKS = {
    "a harness run as a child process": 'run = run_harness("tests.faults.replay_faults", "--trials", "4")\n',
    "a benchmark module named like a harness": "from replay_faults import render\nfrom harness import run_harness\n",
    "the benchmarks directory on sys.path": 'import sys\nsys.path.insert(0, str(Path(__file__).parent))\n',
    "the checkout on a child's PYTHONPATH": 'env = {**os.environ, "PYTHONPATH": str(ROOT)}\n',
    "a results file written": '(RESULTS / "robustness.md").write_text(text)\n',
}


@pytest.mark.parametrize("source", list(ALLOWED_IN_BENCHMARKS.values()), ids=list(ALLOWED_IN_BENCHMARKS))
def test_what_is_not_a_reach_into_tests_passes(source):
    assert problems_in(source, "allowed.py", "tests") == []
