"""Run one case of the real-bug corpus: record both runs, compare, localize, and say what ttrace found.

Input: a `RealBug` (corpus.py), a work directory and a precision. Output: a `CaseResult`, which
serializes to JSON. Compare and localize run as the CLI a user types (`python -m ttrace_core
compare|localize ... --json`), so the verdicts here are the terminal's.

benchmarks/real_bugs.py runs this module as a child process, which writes JSON to --out:

    python -m tests.real_bugs.runner --list --out cases.json     # every case, and a note per absent framework
    python -m tests.real_bugs.runner --case NAME --precision fp32 --work DIR --out row.json   # one CaseResult

The deciding test is the first divergence's own check, as `ttrace compare` reports it: `mismatch`
(values against the reference), `replica_drift` (copies of one logical tensor disagree across ranks),
a structure check (`shape`, `dtype`, `missing`, ...), with "step scalar" added when the tensor is a step
scalar (the loss, the gradient norm).
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tests.real_bugs.corpus import RealBug
from tests.support import warm_cli

ROOT = Path(__file__).resolve().parents[2]
CASE_MODULES = {"megatron-core": "tests.real_bugs.megatron_cases", "pytorch": "tests.real_bugs.pytorch_cases",
                "torchtitan": "tests.real_bugs.torchtitan_cases", "transformers": "tests.real_bugs.transformers_cases"}
RECORD_TIMEOUT_S = 420.0
LOCALIZE_TIMEOUT_S = 600.0


def case_environment() -> dict[str, str]:
    """This repository importable, one thread per rank (2 CPU cores are shared by every rank)."""
    return warm_cli.cli_environment()


def python_command(*args: str) -> list[str]:
    return [sys.executable, *args]


def torchrun_command(num_ranks: int, script: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(num_ranks),
            str(script), *args]


def ttrace_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "ttrace_core", *args]


def _run(command: list[str], timeout_s: float, cwd: Path) -> subprocess.CompletedProcess:
    """`command`; ttrace's own forked from the tests' warm worker under pytest (tests/support/warm_cli.py)."""
    if command[1:3] == ["-m", "ttrace_core"]:
        return warm_cli.run(*command[3:], cwd=cwd, env=case_environment(), timeout=timeout_s)
    return subprocess.run(command, cwd=cwd, env=case_environment(), capture_output=True, text=True, timeout=timeout_s)


def record_command(out: Path, command: list[str], timeout_s: float = RECORD_TIMEOUT_S) -> Path:
    """`ttrace record --out OUT -- COMMAND` from the repository root; raise with its output when it fails."""
    done = _run(ttrace_command("record", "--out", str(out), "--timeout", str(int(timeout_s)), "--", *command),
                timeout_s + 60, ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"recording {out.name} failed (exit {done.returncode}): {' '.join(command)}\n"
                           f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return out


@dataclass(kw_only=True)
class CaseResult:
    name: str
    framework: str
    precision: str
    control: bool
    moe: bool
    source: str
    fix: str | None
    reproduced_by: str
    touched: str
    detected: bool
    """`ttrace compare` failed (for a control: the false alarm)."""
    verdict: str
    """compare's headline: "PASSED (equivalent)", "FAILED (not equivalent)", ..."""
    first_divergence: str | None = None
    """The first failing tensor in execution order, "step S / [mb M /] phase / fqn / slot"."""
    ratio: float | None = None
    """error / tolerance at the first divergence (None for a structural failure)."""
    deciding_test: str | None = None
    """The first divergence's check: mismatch, replica_drift, a structure check; "step scalar: ..." for a scalar."""
    culprits: list[str] = field(default_factory=list)
    """What `ttrace localize` names (modules, or parameters with the reduction that misses them)."""
    bug_class: str = ""
    localized: bool = False
    """A culprit matches one of the case's expected_culprits (always False for a control)."""
    localize_exit: int | None = None
    seconds: float = 0.0
    error: str | None = None
    """Why the case could not be measured (recording failed, timeout); then nothing above is a result."""

    def ok(self) -> bool:
        """A bug: detected and localized. A control: passed."""
        if self.error:
            return False
        return not self.detected if self.control else self.detected and self.localized

    def to_dict(self) -> dict:
        return asdict(self)


def _key_text(key: dict) -> str:
    mb = "" if key["micro_batch"] < 0 else f" / mb {key['micro_batch']}"
    return f"step {key['step']}{mb} / {key['phase']} / {key['fqn']} / {key['slot']}"


def _deciding_test(row: dict) -> str:
    test = row.get("decided_by") or row["status"]
    if row["status"] not in ("mismatch", "replica_drift", "pass"):
        test = row["status"]  # a structure check: shape, dtype, missing, inconsistent, ...
    return f"step scalar: {test}" if row["key"]["slot"].startswith("scalar.") else test


def matches(culprits: list[str], expected: tuple[str, ...]) -> bool:
    """A culprit ("fqn", or "p1, p2 (TP)" for a gradient reduction) matches an expected glob."""
    names = [name.strip() for culprit in culprits for name in culprit.split(" (")[0].split(",")]
    return any(fnmatch.fnmatchcase(name, glob) for name in names + culprits for glob in expected)


def run_case(case: RealBug, work: Path, precision: str = "fp32", *, localize: bool = True) -> CaseResult:
    """Record the case's two runs into `work`, compare them and (for a detected bug) localize it."""
    work.mkdir(parents=True, exist_ok=True)
    result = CaseResult(name=case.name, framework=case.framework, precision=precision, control=case.control,
                        moe=case.moe, source=case.source, fix=case.fix, reproduced_by=case.reproduced_by,
                        touched=case.touched, detected=False, verdict="")
    started = time.monotonic()
    try:
        reference, candidate = case.record(work, precision)
        _compare(result, reference, candidate, work)
        if localize and result.detected and not case.control:
            _localize(result, reference, candidate, work, case.expected_culprits)
    except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as error:
        result.error = f"{type(error).__name__}: {str(error)[-3000:]}"
    result.seconds = round(time.monotonic() - started, 1)
    return result


def _compare(result: CaseResult, reference: Path, candidate: Path, work: Path) -> None:
    out = work / "compare.json"
    done = _run(ttrace_command("compare", str(reference), str(candidate), "--json", str(out)), 600, ROOT)
    if done.returncode not in (0, 1) or not out.is_file():
        raise RuntimeError(f"ttrace compare exited {done.returncode}: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    data = json.loads(out.read_text())
    result.detected = not data["passed"]
    result.verdict = f"{'PASSED' if data['passed'] else 'FAILED'} ({data['verdict']})"
    first = next((row for row in data["comparisons"] if row["status"] != "pass"), None)
    if first is not None:
        result.first_divergence = _key_text(first["key"])
        result.ratio = first.get("ratio")
        result.deciding_test = _deciding_test(first)
    elif data["findings"]:
        result.deciding_test = data["findings"][0]


def _localize(result: CaseResult, reference: Path, candidate: Path, work: Path, expected: tuple[str, ...]) -> None:
    out = work / "localize.json"
    done = _run(ttrace_command("localize", str(reference), str(candidate), "--json", str(out)), LOCALIZE_TIMEOUT_S, ROOT)
    result.localize_exit = done.returncode
    if not out.is_file():
        raise RuntimeError(f"ttrace localize exited {done.returncode}: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    data = json.loads(out.read_text())
    result.culprits = list(data.get("culprits") or [])
    result.bug_class = data.get("bug_class") or ""
    result.localized = matches(result.culprits, expected)


def load_cases() -> tuple[list[RealBug], list[str]]:
    """Every framework module's CASES, and a note per module that is not there."""
    cases, notes = [], []
    for framework, module in CASE_MODULES.items():
        try:
            cases.extend(importlib.import_module(module).CASES)
        except ModuleNotFoundError as error:
            if error.name != module:
                raise
            notes.append(f"{framework}: {module} is not present; its cases were not run")
    return cases, notes


def main() -> None:
    parser = argparse.ArgumentParser(description="List the real-bug cases, or run one of them.")
    parser.add_argument("--list", action="store_true", help="every case (name, framework, slow, summary) and the notes")
    parser.add_argument("--case", help="the name of the case to run")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--work", type=Path, help="where the case's runs are recorded")
    parser.add_argument("--out", type=Path, required=True, help="JSON: the listing, or the case's result and summary")
    args = parser.parse_args()
    cases, notes = load_cases()
    if args.list:
        records = {"cases": [{"name": c.name, "framework": c.framework, "slow": c.slow, "summary": c.summary}
                             for c in cases], "notes": notes}
    else:
        case = next((c for c in cases if c.name == args.case), None)
        if case is None or args.work is None:
            parser.error(f"--case must name one of {[c.name for c in cases]}, with --work")
        records = {**run_case(case, args.work, args.precision).to_dict(), "summary": case.summary}
    args.out.write_text(json.dumps(records))


if __name__ == "__main__":
    main()
