"""Every `*.py` file the README, docs/ or a docstring names exists, and every relative link in the README and
docs/ leads somewhere: a renamed module cannot leave a reader looking for a file that is gone.

A path with a folder (`record/producers.py`, `tests/user_script/train.py`) must exist from the repository's
root, from `ttrace_core/`, or from the naming file's own folder and its parents, or be a file of an installed
framework the text talks about (megatron-core's `transformer/moe/router.py`). A bare file name (`settings.py`)
must be the name of a file in the repository or in one of those frameworks. `ttrace_dashboard/` is `app/`
installed, and `ttrace_dashboard/views/` is `pages/`.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY_PATH = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.py)\b")
SOURCES = ("ttrace_core", "ttrace_examples", "app", "pages", "benchmarks", "tests", "sample_traces")
SKIP = {"setup.py", "conftest.py", "__main__.py", "__init__.py", "train.py"}  # generic names a text may use as a kind of file


def _repo_files() -> set[str]:
    skipped = {".git", "__pycache__", ".pytest_cache", "build", "runs"}
    return {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py") if not skipped & set(p.relative_to(ROOT).parts)}


def _framework_files() -> set[str]:
    """Every .py path under the installed frameworks' top folders (megatron, torch, torchtitan, transformers)."""
    found = set()
    for package in ("megatron", "torch", "torchtitan", "transformers"):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        top = Path(list(spec.submodule_search_locations)[0])
        found |= {f"{package}/{p.relative_to(top).as_posix()}" for p in top.rglob("*.py")}
    return found


FILES = _repo_files()
FRAMEWORK = _framework_files()
NAMES = {Path(f).name for f in FILES | FRAMEWORK} | {"plotly.py"}  # plotly's Python package calls itself so
INSTALLED = {"ttrace_dashboard/views/": "pages/", "ttrace_dashboard/": "app/"}


def exists(named: str, where: Path) -> bool:
    if "/" not in named:
        return named in NAMES or named in SKIP
    for installed, folder in INSTALLED.items():
        if named.startswith(installed):
            named = folder + named.removeprefix(installed)
            break
    bases = [ROOT, ROOT / "ttrace_core", *[parent for parent in where.parents if parent.is_relative_to(ROOT)]]
    return any((base / named).is_file() for base in bases) or any(
        f == named.removeprefix("src/") or f.endswith("/" + named) for f in FRAMEWORK)


def docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text())
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text:
                found.append(text)
    return found


def missing_in(text: str, where: Path) -> list[str]:
    return sorted({m.group(1) for m in PY_PATH.finditer(text) if not exists(m.group(1), where)})


def test_docs_name_existing_python_files():
    problems = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        problems += [f"{page.relative_to(ROOT)}: {name}" for name in missing_in(page.read_text(), page)]
    assert problems == []


def test_docstrings_name_existing_python_files():
    problems = []
    for source in SOURCES:
        for path in sorted((ROOT / source).rglob("*.py")):
            for text in docstrings(path):
                problems += [f"{path.relative_to(ROOT)}: {name}" for name in missing_in(text, path)]
    assert sorted(set(problems)) == []


def test_links_in_the_readme_and_docs_resolve():
    problems = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for match in re.finditer(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", prose):
            target = match.group(1)
            if not re.match(r"(https?|mailto):", target) and not (page.parent / target).exists():
                problems.append(f"{page.relative_to(ROOT)}: {target}")
    assert problems == []


def test_the_check_catches_a_stale_name(tmp_path: Path):
    assert missing_in("see ttrace_core/format/store.py and trace_writer.py", ROOT / "README.md") == [
        "trace_writer.py", "ttrace_core/format/store.py"]
    assert missing_in("see record/producers.py and settings.py", ROOT / "README.md") == []


def test_the_readme_is_a_one_screen_start_with_its_two_commands():
    """Under 200 lines; it opens with exactly two commands (the dashboard on the samples, then the whole suite),
    and the second is the one .ci/run finds and runs."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 200, len(lines)
    block = lines[lines.index("```bash") + 1:lines.index("```", lines.index("```bash") + 1)]
    assert len(block) == 2, block
    serve, suite = block
    assert serve.startswith("pip install ") and serve.endswith("&& ttrace dashboard sample_traces"), serve
    assert "pytest" in suite and "-m" not in suite.split("pytest", 1)[1].split(), suite  # the whole suite
    ci = (ROOT / ".ci" / "run").read_text()
    pattern = re.search(r"grep -m1 -E '([^']+)' README.md", ci).group(1)
    assert next(line for line in lines if re.search(pattern, line)) == suite
    assert 'bash -c "$test_command"' in ci
