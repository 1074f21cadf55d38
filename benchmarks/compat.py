"""Compatibility matrix: ttrace's megatron-core path and core tests under other Pythons, torches and megatron-cores.

For each combination (a Python interpreter, a torch and a megatron-core version, each `pinned` for
requirements.txt's pin, `newest` for the newest release pip will install for that Python, or an exact
version) it makes a venv under the cache directory (reused when present), installs requirements.txt
with those two pins replaced and then `pip install --no-deps -e` of the source, records the exact
versions installed, and runs a chosen set of ttrace's tests in that venv. The source is a commit of
this repository (HEAD by default) exported with `git archive` to <cache>/src, so work in progress in
the tree cannot change the verdict, and the tree itself gets no egg-info or bytecode from another
Python. The main environment is never touched: every pip and pytest runs with the venv's own interpreter.

Writes results/compat.md (and compat.json): per combination the Python, torch, megatron-core and
transformer-engine versions, tests passed / failed / skipped, seconds to install and to test, and
for every failure its test id and a one-line reason. A run over some combinations replaces those
rows and keeps the others.

    python benchmarks/compat.py [--combo PYTHON:TORCH:MEGATRON ...] [--commit HEAD] [--overlay PATH ...]
                                [--tests PATH ...] [--cache ~/.cache/ttrace-compat] [--workers 2] [--reinstall]

    e.g. python benchmarks/compat.py --combo 3.12.1:newest:newest --combo 3.12.1:2.14.1:newest
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PYENV = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
DEFAULT_COMBOS = ["3.11:pinned:pinned", "3.12.1:newest:newest"]
"""The project's own Python with requirements.txt as the baseline; the newest that install on 3.12."""
DEFAULT_TESTS = ["tests/test_megatron_user_script.py", "tests/integrations/test_megatron_cpu.py",
                 "tests/examples/test_megatron_gpt.py", "tests/core", "tests/test_cli.py"]
REPLACED = ("torch", "megatron-core")
"""The requirements a combination substitutes; every other pin in requirements.txt stays as it is..."""
FOLLOWS_TORCH = ("triton",)
"""...but these, which a torch release pins itself, leave with torch's pin."""


@dataclass(kw_only=True, slots=True)
class Combo:
    python: str
    """A pyenv version or its prefix (`3.12.1`, `3.11`), or a path to an interpreter."""
    torch: str
    """`pinned` (requirements.txt), `newest`, or an exact version."""
    megatron_core: str
    """Same forms as `torch`."""

    def __post_init__(self) -> None:
        for name in ("torch", "megatron_core"):
            value = getattr(self, name)
            if value not in ("pinned", "newest") and not re.fullmatch(r"[0-9][0-9A-Za-z.+]*", value):
                raise ValueError(f"--combo {name.replace('_', '-')} {value!r}: "
                                 "give pinned, newest or a version like 2.15.0")

    @classmethod
    def from_spec(cls, spec: str) -> Combo:
        parts = spec.split(":")
        if len(parts) != 3:
            raise ValueError(f"--combo {spec!r}: expected PYTHON:TORCH:MEGATRON, e.g. 3.12.1:newest:newest")
        return cls(python=parts[0], torch=parts[1], megatron_core=parts[2])

    @property
    def label(self) -> str:
        python = self.python if "/" not in self.python else Path(self.python).name
        return f"py{python}-torch-{self.torch}-megatron-core-{self.megatron_core}"

    @property
    def spec(self) -> str:
        return f"{self.python}:{self.torch}:{self.megatron_core}"


@dataclass(kw_only=True, slots=True)
class Row:
    combo: str
    """The `--combo` spec this row ran."""
    commit: str
    """The ttrace commit tested (full sha)."""
    overlay: list[str]
    """Working-tree files copied over that commit (changes not committed yet); empty for the commit as is."""
    python: str
    torch: str
    megatron_core: str
    transformer_engine: str
    """`absent`, or the version that came in as a dependency."""
    passed: int
    failed: int
    """Failures and errors (a fixture that raised counts against each test it served)."""
    skipped: int
    install_s: float
    """Seconds it took to make the venv and install into it (when it was made, for a reused one)."""
    tests_s: float
    """Wall seconds of the pytest run."""
    failures: list[dict] = field(default_factory=list)
    """{"id", "reason", "alone"} per failed test; "alone" is how it went when re-run by itself."""
    skips: list[dict] = field(default_factory=list)
    """{"reason", "count"}: why tests skipped, grouped."""


def interpreter(python: str) -> Path:
    """The interpreter a combination names: a path, or the newest pyenv version with that prefix."""
    if "/" in python:
        return Path(python)
    versions = sorted((p for p in PYENV.glob(f"{python}*") if re.fullmatch(rf"{re.escape(python)}(\.\d+)?", p.name)),
                      key=lambda p: tuple(int(x) for x in p.name.split(".")))
    if not versions:
        raise ValueError(f"no Python {python} under {PYENV}: install it with pyenv or pass the interpreter's path")
    return versions[-1] / "bin" / "python"


def export_source(cache: Path, commit: str, overlay: list[str]) -> tuple[Path, str]:
    """`git archive` of `commit` into <cache>/src, then the working tree's `overlay` files copied over
    it (kept while both are unchanged): (directory, full sha)."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    source = cache / "src"
    stamp = source / ".compat-commit"
    identity = json.dumps([sha, *((path, hashlib.sha256((ROOT / path).read_bytes()).hexdigest())
                                  for path in sorted(overlay))])
    if stamp.exists() and stamp.read_text() == identity:
        return source, sha
    shutil.rmtree(source, ignore_errors=True)
    source.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", sha], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    for path in overlay:
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / path, source / path)
    stamp.write_text(identity)
    return source, sha


def _pins(source: Path) -> dict[str, str]:
    pins = {}
    for line in (source / "requirements.txt").read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split("==")
            pins[name.strip().lower()] = version.strip()
    return pins


def requirement(name: str, choice: str, source: Path) -> str:
    if choice == "pinned":
        return f"{name}=={_pins(source)[name]}"
    return name if choice == "newest" else f"{name}=={choice}"


def _run(command: list[str], log: Path, env: dict | None = None) -> None:
    with open(log, "a") as output:
        output.write(f"\n$ {' '.join(command)}\n")
        output.flush()
        done = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command[:6])} ...` exited {done.returncode}; see {log}")


def requirements_for(combo: Combo, source: Path) -> str:
    """requirements.txt with the combination's torch and megatron-core; triton goes with torch (each
    torch release pins the triton it was built with), so it stays pinned only beside the pinned torch."""
    replaced = REPLACED + (() if combo.torch == "pinned" else FOLLOWS_TORCH)
    kept = [line for line in (source / "requirements.txt").read_text().splitlines()
            if line.split("==")[0].strip().lower() not in replaced]
    return "\n".join(kept + [requirement("torch", combo.torch, source),
                             requirement("megatron-core", combo.megatron_core, source)]) + "\n"


def install(combo: Combo, venv: Path, source: Path, reinstall: bool) -> float:
    """Make the venv and install the requirements into it, unless an install of the same requirements is
    there; then ttrace itself from `source` (cheap, and the export may be of another commit). Returns
    the seconds the requirements' install took (when it was made, for a reused venv)."""
    marker = venv / "compat-installed.json"
    log = venv.parent / f"{venv.name}.install.log"
    python = str(venv / "bin" / "python")
    # This machine's pip config caps torch (a constraint file for the wheels on its disk), and an
    # empty PIP_CONSTRAINT does not override it (pip skips empty settings); the combination names
    # its torch itself, so the cap is lifted here, for this venv's pip only.
    env = {**os.environ, "PIP_CONSTRAINT": "/dev/null"}
    wanted = requirements_for(combo, source)
    if reinstall:
        shutil.rmtree(venv, ignore_errors=True)
    done = json.loads(marker.read_text()) if marker.exists() else {}
    if done.get("requirements") != wanted:
        started = time.perf_counter()
        venv.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as output:
            output.write(f"\n# {combo.spec}\n")
        if not (venv / "bin" / "python").exists():
            _run([str(interpreter(combo.python)), "-m", "venv", str(venv)], log)
        requirements = venv / "compat-requirements.txt"
        requirements.write_text(wanted)
        _run([python, "-m", "pip", "install", "--progress-bar", "off", "-r", str(requirements)], log, env)
        # A venv made for an older requirements list keeps the time of its first install.
        done = {"combo": combo.spec, "install_s": done.get("install_s") or round(time.perf_counter() - started, 1),
                "requirements": wanted}
        marker.write_text(json.dumps(done))
    _run([python, "-m", "pip", "install", "--progress-bar", "off", "--no-deps", "-e", str(source)], log, env)
    return done["install_s"]


VERSIONS = """
import importlib.metadata as m, json, platform
def v(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "absent"
print(json.dumps({"python": platform.python_version(), "torch": v("torch"), "megatron_core": v("megatron-core"),
                  "transformer_engine": v("transformer-engine") if v("transformer-engine") != "absent"
                  else v("transformer_engine"), "xdist": v("pytest-xdist")}))
"""


def installed_versions(venv: Path) -> dict:
    done = subprocess.run([str(venv / "bin" / "python"), "-c", VERSIONS], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def node_id(classname: str, name: str, source: Path) -> str:
    """pytest's test id from a junit testcase: the longest dotted prefix that is a file is the module."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (source / path).exists():
            return "::".join([path, *parts[cut:], name])
    return f"{classname}::{name}"


RAISED = re.compile(r"^(?:\[rank\d+\]:\s*)?([\w.]*(?:Error|Exception): \S.*)$")
"""An exception line in captured output (a rank's traceback under torchrun prefixes it with [rankN]:)."""


def _one_line(text: str | None, limit: int = 240) -> str:
    """The message's first line; when that only introduces captured output (a subprocess's stderr),
    the first exception raised in that output after it."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    line = lines[0] if lines else "(no message)"
    raised = next((match.group(1) for later in lines[1:] if (match := RAISED.match(later))), None)
    if raised:
        line = f"{line} ... {raised}"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def read_junit(path: Path, source: Path) -> tuple[int, int, int, list[dict], list[dict]]:
    passed = failed = skipped = 0
    failures, skip_reasons = [], {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = node_id(case.get("classname", ""), case.get("name", ""), source)
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            failed += 1
            failures.append({"id": test_id, "reason": _one_line(bad.get("message") or bad.text)})
        elif skip is not None:
            skipped += 1
            reason = _one_line(skip.get("message") or skip.text)
            skip_reasons[reason] = skip_reasons.get(reason, 0) + 1
        else:
            passed += 1
    skips = [{"reason": reason, "count": count} for reason, count in sorted(skip_reasons.items())]
    return passed, failed, skipped, failures, skips


def run_tests(venv: Path, source: Path, tests: list[str], workers: int, xdist: bool, timeout: float,
              name: str = "") -> tuple[float, Path]:
    junit = venv.parent / f"{venv.name}{name}.junit.xml"
    junit.unlink(missing_ok=True)
    command = [str(venv / "bin" / "python"), "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE",
               f"--junitxml={junit}", *(["-n", str(workers)] if xdist and workers > 1 else []), *tests]
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    # torchrun and the venv's other scripts come first on PATH; no bytecode for another Python lands in the tree.
    env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
               PYTHONDONTWRITEBYTECODE="1", COLUMNS="200")
    log = venv.parent / f"{venv.name}{name}.pytest.log"
    started = time.perf_counter()
    with open(log, "w") as output:
        done = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=source, timeout=timeout)
    seconds = time.perf_counter() - started
    if not junit.exists():
        raise RuntimeError(f"pytest exited {done.returncode} without a junit report; see {log}")
    return seconds, junit


def rerun_alone(venv: Path, source: Path, failures: list[dict], timeout: float) -> None:
    """Run each failed test once more, by itself: one that passes then failed only under the load of the
    whole run (another worker, other jobs on the machine), which the row says beside its reason."""
    for number, failure in enumerate(failures):
        _, junit = run_tests(venv, source, [failure["id"]], 1, False, timeout, name=f".rerun{number}")
        failure["alone"] = "passed" if read_junit(junit, source)[:2] == (1, 0) else "failed"


def run_combo(combo: Combo, cache: Path, source: Path, commit: str, overlay: list[str], tests: list[str],
              workers: int, reinstall: bool, timeout: float) -> Row:
    venv = cache / "venvs" / combo.label
    print(f"[{combo.label}] installing into {venv}", flush=True)
    install_s = install(combo, venv, source, reinstall)
    versions = installed_versions(venv)
    print(f"[{combo.label}] python {versions['python']}, torch {versions['torch']}, megatron-core "
          f"{versions['megatron_core']}; running {len(tests)} test paths", flush=True)
    tests_s, junit = run_tests(venv, source, tests, workers, versions["xdist"] != "absent", timeout)
    passed, failed, skipped, failures, skips = read_junit(junit, source)
    print(f"[{combo.label}] {passed} passed, {failed} failed, {skipped} skipped in {tests_s:.0f} s", flush=True)
    rerun_alone(venv, source, failures, timeout)
    return Row(combo=combo.spec, commit=commit, overlay=overlay, python=versions["python"], torch=versions["torch"],
               megatron_core=versions["megatron_core"], transformer_engine=versions["transformer_engine"],
               passed=passed, failed=failed, skipped=skipped, install_s=round(install_s, 1),
               tests_s=round(tests_s, 1), failures=failures, skips=skips)


def table_row(row: dict) -> str:
    """One line of compat.md's table; tests/test_compat_figures.py reads it back against compat.json."""
    commit = row["commit"][:10] + (f" + {len(row['overlay'])} files" if row["overlay"] else "")
    cells = [f"`{row['combo']}`", commit, row["python"], row["torch"], row["megatron_core"], row["transformer_engine"],
             str(row["passed"]), str(row["failed"]), str(row["skipped"]), f"{row['tests_s']:.0f}",
             f"{row['install_s']:.0f}"]
    return "| " + " | ".join(cells) + " |"


ALONE = {"passed": " (re-run alone: **passed**; it failed only under the whole run's load)",
         "failed": " (re-run alone: failed again)"}


def render(results: dict) -> str:
    lines = [
        "# Compatibility: Python, torch and megatron-core versions",
        "",
        f"`python benchmarks/compat.py {' '.join('--combo ' + r['combo'] for r in results['rows'])}`, "
        f"last run {results['date']} on 2 CPU cores shared with other jobs (no GPU). Each combination is a venv with "
        "requirements.txt's other pins, torch and megatron-core as named (`pinned` = requirements.txt, `newest` = "
        "the newest release pip installs for that Python), and `pip install --no-deps -e` of the ttrace commit "
        "named in the table (exported with `git archive`). Tests run there:",
        "",
        f"    python -m pytest -p no:cacheprovider -n {results['workers']} {' '.join(results['tests'])}",
        "",
        "Seconds are wall time; install s is what making the venv took when it was first made (later runs reuse "
        "it), with the package index's wheels already in pip's cache.",
        "",
        "| combination | ttrace commit | Python | torch | megatron-core | transformer-engine | passed | failed "
        "| skipped | tests s | install s |",
        "| --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
        *(table_row(row) for row in results["rows"]),
    ]
    for row in results["rows"]:
        lines += ["", f"## `{row['combo']}`: {row['failed']} failed", ""]
        if row["overlay"]:
            lines += [f"ttrace {row['commit'][:10]} with these working-tree files over it: "
                      + ", ".join(f"`{path}`" for path in row["overlay"]), ""]
        lines += [f"- `{f['id']}`: {f['reason']}" + ALONE.get(f.get("alone"), "")
                  for f in row["failures"]] or ["No failures."]
        if row["skips"]:
            lines += ["", "Skipped:", ""] + [f"- {s['count']} x {s['reason']}" for s in row["skips"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--combo", action="append",
                        help=f"PYTHON:TORCH:MEGATRON, repeatable (default: {' '.join(DEFAULT_COMBOS)})")
    parser.add_argument("--commit", default="HEAD", help="the ttrace commit to test (exported, never checked out)")
    parser.add_argument("--overlay", nargs="+", default=[], metavar="PATH",
                        help="working-tree files to test in place of the commit's (uncommitted fixes)")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "ttrace-compat")
    parser.add_argument("--tests", nargs="+", default=DEFAULT_TESTS)
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers, where it installs")
    parser.add_argument("--reinstall", action="store_true", help="make the combinations' venvs anew")
    parser.add_argument("--timeout", type=float, default=5400, help="seconds for one combination's tests")
    args = parser.parse_args(argv)
    combos = [Combo.from_spec(spec) for spec in (args.combo or DEFAULT_COMBOS)]
    cache = args.cache.expanduser()
    overlay = sorted(args.overlay)
    source, commit = export_source(cache, args.commit, overlay)
    json_path = RESULTS / "compat.json"
    previous = json.loads(json_path.read_text()) if json_path.exists() else {"rows": []}
    if previous.get("tests", args.tests) != args.tests:
        previous["rows"] = []  # rows over another test set do not compare
    rows = {row["combo"]: {"overlay": [], **row} for row in previous["rows"]}
    for combo in combos:
        rows[combo.spec] = asdict(run_combo(combo, cache, source, commit, overlay, args.tests, args.workers,
                                            args.reinstall, args.timeout))
        results = {"date": date.today().isoformat(), "tests": args.tests, "workers": args.workers,
                   "rows": list(rows.values())}
        RESULTS.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=1) + "\n")
        (RESULTS / "compat.md").write_text(render(results))
    print((RESULTS / "compat.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
