"""The robustness harness: the damaged-trace cases, and the answer ttrace gives to each.

Generates: the base pair (`record_base`: a small megatron-core pair, a 1-rank reference with a
tolerance estimate and a TP2 + SP candidate, 1 layer, 1 step, with a finished replay job), every case
of every damage family (`catalogue`: corruptions.py, byte_damage.py, size_lies.py, special_files.py,
misplaced_objects.py, stale_cache.py),
and `run_all`, which damages a fresh copy per case and runs `ttrace inspect`, `ttrace compare` and the
dashboard's API (`api.find_runs`, `api.comparison_table`) on it, each case in a forked process with a
time limit and a memory limit. Every answer is counted as one of:

- crash: a traceback, exit 3, or the answering process killed by a signal (a segmentation fault in HDF5);
- hang: no answer within the time limit;
- error: exit 2 with one line that names the file or the tensor ("unclear error" when it does not,
  and when the API's table names other directories than the ones passed: a table reused from the run
  the candidate was copied from);
- finding: exit 1 (compare: a divergence or incomplete evidence, named);
- pass: exit 0. A pass on a *material* corruption (decided by pristine.py when the case does not say)
  is a **silent pass**.

Ways out of the trace (links, virtual datasets, external storage, symlinks) also count **reads
outside**: whether the file they lead to was read at all (its access time, on tmpfs).

Used by tests/test_robustness.py (a slice of the catalogue), tests/conftest.py (the `robustness_base`
fixture) and, as a child process, by benchmarks/robustness.py (every case, its tables and
results/robustness.{md,csv}):

    python -m tests.faults.damage_runner --work DIR --jobs 2 --seed 0 --scale 1 --out answers.json

records the base, answers every case of the catalogue and writes each case's answers, with the
seconds all of them took and the harness's constants the tables name.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.faults import byte_damage, corruptions, misplaced_objects, size_lies, special_files, stale_cache
from tests.faults.pristine import Pristine

BASE_FLAGS = ["--num-layers", "1", "--hidden-size", "32", "--seq-len", "8", "--micro-batches", "1", "--steps", "1"]
COMMANDS = ("inspect", "compare", "api")
TIME_LIMIT_S = 60.0
ORACLE_TIME_LIMIT_S = 30.0
REPLAYED_MODULE = "decoder.layers.0"
CHILD_MEMORY_BYTES = 8 * 2**30
"""Address space of the process answering a case: a damaged trace that makes ttrace allocate more fails
there (and counts as a crash) instead of waking the kernel's OOM killer on a shared machine."""


def record_base(work: Path) -> tuple[Path, Path]:
    reference, candidate = work / "base" / "reference", work / "base" / "candidate"
    for run, flags in ((reference, []), (candidate, ["--tp", "2", "--sp"])):
        if not (run / "manifest.json").is_file():
            shutil.rmtree(run, ignore_errors=True)
            subprocess.run(["ttrace", "example", "megatron-gpt", *BASE_FLAGS, *flags, "--out", str(run)], check=True,
                           capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if not (reference / "tolerance_estimate.json").is_file():
        # The default 4 samples: with 2, the largest deviation seen can fall short of a clean TP run's
        # (measured: a post-step bias at ratio 1.1 on one machine, 0.6 with 4 samples).
        subprocess.run(["ttrace", "estimate", str(reference)], check=True, capture_output=True)
    if not (candidate / ".ttrace" / "jobs").is_dir():
        replay_base(reference, candidate)
    return reference, candidate


def replay_base(reference: Path, candidate: Path) -> None:
    """A finished replay job in the candidate (its files are damaged by the "replay job files" cases);
    the comparison cache it leaves is removed, so every case compares afresh."""
    from ttrace_core import api

    job = api.submit_replay(reference, candidate, REPLAYED_MODULE)
    assert job.wait(timeout_s=600).state == "complete", job.log_tail()
    shutil.rmtree(candidate / ".ttrace" / "comparisons", ignore_errors=True)


def catalogue(pair: tuple[Path, Path], seed: int, scale: int) -> list[corruptions.Corruption]:
    rng = random.Random(seed)
    has_estimate = (pair[0] / "tolerance_estimate.json").is_file()
    return [
        *corruptions.bit_flips(pair, 450 * scale, rng),
        *corruptions.truncations(pair, rng, 60 * scale),
        *corruptions.metadata_lies(pair, rng, per_lie=6 * scale),
        *corruptions.attribute_damage(pair, rng, 40 * scale),
        *corruptions.value_damage(pair, rng, per_change=12 * scale),
        *corruptions.duplicated_tensors(pair, rng, 20 * scale),
        *corruptions.missing_files(pair),
        *corruptions.hostile_manifests(),
        *corruptions.estimate_damage(has_estimate),
        *corruptions.ways_out(pair),
        *corruptions.job_file_damage(),
        *byte_damage.byte_ranges(pair, rng, 600 * scale, zeroed=True),
        *byte_damage.byte_ranges(pair, rng, 600 * scale, zeroed=False),
        *byte_damage.heap_damage(pair, rng, 300 * scale),
        *byte_damage.header_flips(pair, rng, 600 * scale),
        *(case for message in byte_damage.MESSAGE_TYPES for case in byte_damage.message_flips(pair, rng, 300 * scale, message)),
        *byte_damage.group_structure_flips(pair, rng, 300 * scale),
        *size_lies.unallocated_shapes(pair, rng, per_lie=8 * scale),
        *size_lies.huge_metadata(pair, rng, per_lie=8 * scale),
        *special_files.special_files(pair),
        *special_files.unreadable_estimates(has_estimate),
        *misplaced_objects.misplaced_objects(pair),
        *stale_cache.stale_caches(pair),
    ]


def _answer_of_cli(argv: list[str], work: Path) -> dict:
    from ttrace_core.cli.main import main as ttrace_main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = ttrace_main(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 2
        except BaseException as error:  # noqa: BLE001 - anything escaping main is a crash
            return {"outcome": "crash", "line": f"{type(error).__name__}: {error}"[:300]}
    return _classified(code, out.getvalue(), err.getvalue(), work)


def _classified(code: int, out: str, err: str, work: Path) -> dict:
    lines = err.strip().splitlines()
    if code == 3 or "Traceback" in err:
        return {"outcome": "crash", "line": (lines[-1] if lines else "")[:300]}
    if code == 2:
        named = len(lines) == 1 and (str(work) in lines[0] or "step " in lines[0])
        return {"outcome": "error" if named else "unclear error", "line": (lines[-1] if lines else "")[:300]}
    if code == 1:
        finding = next((line for line in out.splitlines() if line.startswith(("finding:", "FAILED"))), "")
        return {"outcome": "finding", "line": finding[:300]}
    return {"outcome": "pass", "line": ""}


def _answer_of_api(reference: Path, candidate: Path, work: Path) -> dict:
    from ttrace_core import api
    from ttrace_core.errors import TtraceError

    try:
        for run in api.find_runs(work):
            if run.error is not None and "\n" in run.error:
                return {"outcome": "unclear error", "line": run.error[:300]}
        provenance = api.comparison_table(reference, candidate).provenance
        _touch_replay_job(api, reference, candidate)
    except TtraceError as error:
        text = str(error)
        named = "\n" not in text and (str(work) in text or "step " in text)
        return {"outcome": "error" if named else "unclear error", "line": text[:300]}
    except BaseException as error:  # noqa: BLE001
        return {"outcome": "crash", "line": f"{type(error).__name__}: {error}"[:300]}
    named = (provenance.get("reference"), provenance.get("candidate"))
    if named != (str(reference), str(candidate)):
        return {"outcome": "unclear error", "line": f"the table names {named}, not the directories passed"[:300]}
    if provenance.get("passed"):
        return {"outcome": "pass", "line": ""}
    return {"outcome": "finding", "line": "; ".join(provenance.get("findings") or [provenance.get("verdict", "")])[:300]}


def _touch_replay_job(api, reference: Path, candidate: Path) -> None:
    """What the Localize page does with a replay job it finds: its status, log, verdict, and a cancel."""
    job = api.replay_job(reference, candidate, REPLAYED_MODULE)
    if job is None:
        return
    status = job.status()
    job.log_tail()
    if status.state == "complete":
        api.localization(job)
    job.cancel()


def run_case(case: corruptions.Corruption, base: tuple[Path, Path], work: Path, pristine: Pristine, result_path: Path) -> None:
    """In a forked child: damage a copy, then answer every command; the result file grows one
    command at a time, so a hang shows which command hung."""
    shutil.rmtree(work, ignore_errors=True)
    reference, candidate = work / "reference", work / "candidate"
    shutil.copytree(base[0], reference)
    shutil.copytree(base[1], candidate)
    case.damage(reference, candidate)
    material = case.material if case.material is not None else _material_in_child(pristine, reference, candidate)
    outside = corruptions.outside_of(candidate)
    sentinels = sorted(outside.iterdir()) if outside.is_dir() else []
    for sentinel in sentinels:  # files a way out of the trace leads to: any read moves their access time
        corruptions.untouched(sentinel)
    result = {"kind": case.kind, "name": case.name, "material": material, "read_outside": False}
    for command in COMMANDS:
        result_path.write_text(json.dumps({**result, "running": command}))
        if command == "api":
            result[command] = _answer_of_api(reference, candidate, work)
        else:
            argv = ["inspect", str(candidate)] if command == "inspect" else ["compare", str(reference), str(candidate)]
            result[command] = _answer_of_cli(argv, work)
    result["read_outside"] = any(corruptions.was_read(sentinel) for sentinel in sentinels)
    shutil.rmtree(outside, ignore_errors=True)
    result_path.write_text(json.dumps(result))


def _one_thread_after_fork() -> None:
    """In a forked child: torch computes on one thread. The parent may already run torch's OpenMP pool (a test
    process started without OMP_NUM_THREADS=1 has compared before it forks), whose threads the fork did not
    copy: the child's first parallel region (a float64 dot in compare) would wait on them forever. A region
    of one thread uses no pool."""
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def _material_in_child(pristine: Pristine, reference: Path, candidate: Path) -> bool:
    """The oracle's answer, from a process of its own: a file h5py crashes on (a segmentation fault) or
    never finishes reading cannot be read at all, which is material."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _one_thread_after_fork()
            os.write(write_end, b"1" if pristine.material_change(reference, candidate) else b"0")
        finally:
            os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + ORACLE_TIME_LIMIT_S
    while os.waitpid(pid, os.WNOHANG)[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.01)
    answer = os.read(read_end, 1)
    os.close(read_end)
    return answer != b"0"


def _reaped(running: dict) -> tuple[int, int] | None:
    """(pid, wait status) of a child of `running` that has ended; only our own children (waitpid(-1)
    would also reap other children of this process)."""
    for child in running:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid == child:
            return pid, status
    return None


def _preload() -> None:
    """Import what every case's answers import (the CLI, the dashboard's API and the stages behind them) once,
    before forking: each child inherits them instead of importing pandas, torch's extras and the core again
    (0.8 s a case, more where bytecode is not cached)."""
    import ttrace_core.api  # noqa: F401
    import ttrace_core.cli.main  # noqa: F401
    import ttrace_core.service.comparisons  # noqa: F401
    import ttrace_core.service.replays  # noqa: F401
    import ttrace_core.service.runs  # noqa: F401


def run_all(cases: list[corruptions.Corruption], base: tuple[Path, Path], work: Path, jobs: int) -> list[dict]:
    _preload()
    pristine = Pristine(*base)
    (work / "results").mkdir(parents=True, exist_ok=True)
    running: dict[int, tuple[int, float, Path, corruptions.Corruption]] = {}
    timed_out: set[int] = set()
    results: list[dict] = []
    pending = list(enumerate(cases))
    while pending or running:
        while pending and len(running) < jobs:
            index, case = pending.pop(0)
            result_path = work / "results" / f"{index:05d}.json"
            pid = os.fork()
            if pid == 0:  # the child answers one case and leaves without running the parent's cleanup
                try:
                    _one_thread_after_fork()
                    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY_BYTES, CHILD_MEMORY_BYTES))
                    run_case(case, base, work / "cases" / f"{index:05d}", pristine, result_path)
                finally:
                    os._exit(0)
            running[pid] = (index, time.monotonic(), result_path, case)
        if (ended := _reaped(running)) is None:
            for child, (index, started, result_path, case) in list(running.items()):
                if time.monotonic() - started > TIME_LIMIT_S and child not in timed_out:
                    os.kill(child, signal.SIGKILL)
                    timed_out.add(child)
            time.sleep(0.02)
            continue
        pid, status = ended
        index, started, result_path, case = running.pop(pid)
        results.append(_finished(result_path, case, time.monotonic() - started, _death_of(status, pid in timed_out)))
        shutil.rmtree(work / "cases" / f"{index:05d}", ignore_errors=True)
        if len(results) % 100 == 0:
            print(f"{len(results)}/{len(cases)} cases", file=sys.stderr)
    return results


def _death_of(status: int, timed_out: bool) -> str | None:
    """How a case's process ended, when it did not end by itself: None (it did), "" (killed at the time
    limit: a hang), or what killed it (a crash)."""
    if timed_out:
        return ""
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return None if os.WEXITSTATUS(status) == 0 else f"exited {os.WEXITSTATUS(status)}"


def _finished(result_path: Path, case: corruptions.Corruption, seconds: float, death: str | None) -> dict:
    try:
        result = json.loads(result_path.read_text())
    except (OSError, ValueError):
        result = {"kind": case.kind, "name": case.name, "material": case.material, "read_outside": False,
                  "running": COMMANDS[0]}
    stopped_in = result.pop("running", None)
    if stopped_in is not None:  # killed at the time limit (a hang), or died (a crash), inside this command
        outcome = {"outcome": "hang", "line": ""} if death == "" else {"outcome": "crash", "line": death or "died"}
        for command in COMMANDS[COMMANDS.index(stopped_in):]:
            result[command] = outcome if command == stopped_in else {"outcome": "not run", "line": ""}
    result["seconds"] = round(seconds, 2)
    result["silent"] = bool(result["material"]) and any(result[c]["outcome"] == "pass" for c in ("compare", "api"))
    return result


OUTCOMES = ("crash", "hang", "unclear error", "error", "finding", "pass")


def first_of_each_class(cases: list[corruptions.Corruption], per_class: int) -> list[corruptions.Corruption]:
    taken: dict[str, int] = {}
    kept = []
    for case in cases:
        taken[case.kind] = taken.get(case.kind, 0) + 1
        if taken[case.kind] <= per_class:
            kept.append(case)
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description="Every damaged-trace case of the catalogue, answered.")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=int, default=1, help="multiplies the random cases of every class")
    parser.add_argument("--per-class", type=int, default=None, help="only the first N cases of every class (a smoke run)")
    parser.add_argument("--out", type=Path, required=True, help="JSON: every case's answers and the seconds they took")
    args = parser.parse_args()
    base = record_base(args.work)
    cases = catalogue(base, args.seed, args.scale)
    if args.per_class is not None:
        cases = first_of_each_class(cases, args.per_class)
    started = time.monotonic()
    results = run_all(cases, base, args.work, args.jobs)
    args.out.write_text(json.dumps({"seconds": time.monotonic() - started, "results": results, "commands": COMMANDS,
                                    "outcomes": OUTCOMES, "base_flags": BASE_FLAGS, "time_limit_s": TIME_LIMIT_S,
                                    "child_memory_bytes": CHILD_MEMORY_BYTES}))


if __name__ == "__main__":
    main()
