"""Faults while recording: a recording killed at random points, and a disk that fills up.

The workload (record_steps.py) records 4 steps of the example GPT on one rank and prints "step K
done" as each step file is completed. Every trial is checked against one uninterrupted run:

- SIGKILL at a uniformly random time over the run, --trials times. Every step the run reported done
  must be complete, readable and bitwise equal to the uninterrupted run's; a step cut short must be
  named partial; the trace must open (no error) in every trial.
- A rank that dies: the example GPT with TP 2, one rank (chosen at random) SIGKILLed at a random time
  (tests/faults/rank_faults.py, run as a child process): no finished step lost, every completed file
  bitwise the uninterrupted run's, the launcher stops without a hang, and the trace names the dead rank.
- A full disk: the run records into a tmpfs of a few sizes (mounted here; it needs root) or, where
  mounting is refused, under a file-size limit (RLIMIT_FSIZE). The recording must stop with one clear
  line on stderr ("... recording stopped for the rest of the run and training goes on ...") while the
  training finishes, and keep every step it finished.

Writes results/recording_faults.md.

    python benchmarks/recording_faults.py [--trials 40] [--rank-trials 16] [--work /tmp/ttrace-recording-faults]
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fault_summary import FaultRow, write_rows
from harness import run_harness
from ttrace_core.compare.engine import compare_runs
from ttrace_core.compare.tolerances import DtypeTolerances
from ttrace_core.errors import TtraceError
from ttrace_core.format.reader import RunReader

RESULTS = Path(__file__).parent / "results"
WORKLOAD = Path(__file__).parent / "record_steps.py"
STEPS = 4
DISK_SIZES_MB = (6, 16, 27, 38)


@dataclass
class Trial:
    kind: str
    detail: str
    reported_done: list[int] = field(default_factory=list)
    complete: list[int] = field(default_factory=list)
    partial: list[int] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    """Steps the run reported done that are not complete and equal to the uninterrupted run's."""
    unreadable: str = ""
    error_line: str = ""


def run_workload(out: Path, *, kill_after: float | None = None, file_size_limit: int | None = None) -> tuple[int, str, str]:
    def limit() -> None:
        if file_size_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    process = subprocess.Popen([sys.executable, str(WORKLOAD), str(out), str(STEPS)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, preexec_fn=limit,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        stdout, stderr = process.communicate(timeout=kill_after)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
    return process.returncode, stdout, stderr


def checked(trial: Trial, out: Path, pristine: Path, stdout: str) -> Trial:
    trial.reported_done = [int(line.split()[1]) for line in stdout.splitlines() if line.endswith(" done")]
    try:
        with RunReader(pristine) as reference, RunReader(out) as candidate:
            trial.complete, trial.partial = list(candidate.complete_steps), sorted(candidate.partial_steps)
            rows = compare_runs(reference, candidate, DtypeTolerances(), exact_inputs_k=None).comparisons
    except TtraceError as error:
        if not (out / "manifest.json").exists() and not trial.reported_done:
            trial.partial = ["not started"]  # killed before the tracer wrote its manifest: nothing was recorded
            return trial
        trial.unreadable = str(error)
        trial.lost = trial.reported_done
        return trial
    differing = {c.key.step for c in rows if c.key.step in trial.complete and (c.status != "pass" or c.abs_error != 0)}
    trial.lost = [s for s in trial.reported_done if s not in trial.complete or s in differing]
    return trial


def kill_trials(work: Path, pristine: Path, seconds: float, count: int, rng: random.Random) -> list[Trial]:
    trials = []
    for index in range(count):
        out = work / f"killed-{index}"
        shutil.rmtree(out, ignore_errors=True)
        delay = rng.uniform(0.5, seconds)
        _, stdout, _ = run_workload(out, kill_after=delay)
        trials.append(checked(Trial("SIGKILL", f"after {delay:.2f} s"), out, pristine, stdout))
        shutil.rmtree(out, ignore_errors=True)
    return trials


def dead_rank_trials(work: Path, count: int, seed: int) -> dict:
    """The child's trials (tests/faults/rank_faults.py) and the seconds the ranks of an uninterrupted TP 2
    run take from their start to the launcher's exit."""
    return run_harness("tests.faults.rank_faults", "--work", str(work), "--steps", str(STEPS), "--trials", str(count),
                       "--seed", str(seed))


def _mount_tmpfs(path: Path, size_mb: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def full_disk_trials(work: Path, pristine: Path) -> list[Trial]:
    trials = []
    for size_mb in DISK_SIZES_MB:
        disk = work / f"disk-{size_mb}mb"
        mounted = _mount_tmpfs(disk, size_mb)
        out = disk / "run"
        shutil.rmtree(out, ignore_errors=True)
        code, stdout, stderr = run_workload(out, file_size_limit=None if mounted else size_mb * 2**20)
        kind = f"full disk ({size_mb} MiB tmpfs)" if mounted else f"file-size limit ({size_mb} MiB)"
        trial = checked(Trial(kind, f"exit {code}"), out, pristine, stdout)
        lines = [line for line in stderr.splitlines() if "cannot write step" in line]
        trial.error_line = lines[0] if len(lines) == 1 and code == 0 else stderr.strip()[-300:]
        trials.append(trial)
        if mounted:
            subprocess.run(["umount", str(disk)], capture_output=True)
    return trials


def render(kills: list[Trial], disks: list[Trial], seconds: float) -> str:
    not_started = sum(1 for t in kills if t.partial == ["not started"])
    mid_step = sum(1 for t in kills if t.partial and t.partial != ["not started"])
    done = sum(len(t.reported_done) for t in kills)
    lines = ["# Recording faults", "",
             f"`python benchmarks/recording_faults.py`: the example GPT recorded for {STEPS} steps on one rank "
             f"(about {seconds:.1f} s uninterrupted, 10 MB per step), each trial checked against an uninterrupted run.", "",
             "## SIGKILL at a random time", "",
             f"**{sum(len(t.lost) for t in kills)} completed steps lost** over {len(kills)} trials ({done} steps reported "
             f"done); in {mid_step} trials the kill left a step unfinished, and the reader names it partial (column "
             "partial); "
             f"{not_started} were killed before the recording started (no manifest yet); "
             f"{sum(1 for t in kills if t.unreadable)} traces could not be opened.", "",
             "| trial | killed | steps reported done | complete | partial | lost |", "|---|---|---|---|---|---|"]
    lines += [f"| {i} | {t.detail} | {t.reported_done} | {t.complete} | {t.partial} | {t.lost or '-'} |"
              for i, t in enumerate(kills)]
    lines += ["", "## A full disk", "",
              "| limit | steps reported done | complete | partial | lost | last line of the error |", "|---|---|---|---|---|---|"]
    lines += [f"| {t.kind} | {t.reported_done} | {t.complete} | {t.partial} | {t.lost or '-'} | {t.error_line[:220]} |"
              for t in disks]
    return "\n".join(lines) + "\n"


def render_dead_ranks(dead: dict) -> str:
    trials, seconds = dead["trials"], dead["seconds"]
    done = sum(len(t["done_before"]) for t in trials)
    lines = ["## A rank that dies", "",
             f"`ttrace example torch-gpt --tp 2 --steps {STEPS}` (its ranks run {seconds:.1f} s uninterrupted); one rank, "
             "chosen at random, SIGKILLed at a random time after the ranks start. The launcher sends the other rank "
             "SIGTERM, so its tracer writes what stopped it into its partial step file; the killed rank leaves no word.", "",
             f"**{sum(len(t['lost']) for t in trials)} completed steps lost** over {len(trials)} trials ({done} steps "
             f"finished by every rank before the kill); **{sum(len(t['inconsistent_files']) for t in trials)} completed "
             f"step files differ** from the uninterrupted run's; **{sum(t['hang'] for t in trials)} hangs** (launcher "
             f"still running {dead['stop_limit_s']:.0f} s after the kill; slowest stop "
             f"{max(t['stop_seconds'] for t in trials):.1f} s); the trace names the dead rank in "
             f"**{sum(t['named'] for t in trials)} of {len(trials)}** trials and blames a survivor in "
             f"{sum(bool(t['survivors_blamed']) for t in trials)}; {sum(t['not_started'] for t in trials)} kills "
             "came before the recording began (no run directory yet: the launcher's line names the rank).", "",
             "| trial | killed | done before the kill | complete | partial steps, as the trace explains them | "
             "lost | files differing | stop (s) | launcher's last line |",
             "|---|---|---|---|---|---|---|---|---|"]
    for index, t in enumerate(trials):
        partial = "<br>".join(f"{step}: {why}" for step, why in t["partial"].items()) or t["unreadable"] or "-"
        lines.append(f"| {index} | {t['detail']} | {t['done_before']} | {t['complete']} | {partial[:400]} | "
                     f"{t['lost'] or '-'} | {t['inconsistent_files'] or '-'} | {t['stop_seconds']:.1f} | "
                     f"{t['error_line'][:160]} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ttrace-recording-faults"))
    parser.add_argument("--rank-trials", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    pristine = args.work / "pristine"
    shutil.rmtree(pristine, ignore_errors=True)
    started = time.monotonic()
    code, _, stderr = run_workload(pristine)
    seconds = time.monotonic() - started
    assert code == 0, stderr
    kills = kill_trials(args.work, pristine, seconds, args.trials, random.Random(args.seed))
    disks = full_disk_trials(args.work, pristine)
    dead = dead_rank_trials(args.work, args.rank_trials, args.seed + 1)
    text = render(kills, disks, seconds) + "\n" + render_dead_ranks(dead)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "recording_faults.md").write_text(text)
    write_rows(args.results, "recording_faults", summary_rows(kills, disks, dead))
    print(text)


def summary_rows(kills: list[Trial], disks: list[Trial], dead_run: dict) -> list[FaultRow]:
    def lost(trials: list[Trial]) -> int:
        return sum(len(t.lost) for t in trials)

    dead = dead_run["trials"]
    unclear_disk = [t for t in disks if "recording stopped" not in t.error_line]
    dead_failures = [t for t in dead
                     if t["lost"] or t["inconsistent_files"] or t["hang"] or not t["named"] or t["survivors_blamed"]]
    return [
        FaultRow("SIGKILL while recording", len(kills), crashes=sum(bool(t.unreadable) for t in kills), lost=lost(kills),
                 failures=sum(bool(t.lost or t.unreadable) for t in kills),
                 measured=f"{sum(len(t.reported_done) for t in kills)} steps done before the kills"),
        FaultRow("full disk while recording", len(disks), crashes=len(unclear_disk), lost=lost(disks),
                 failures=sum(bool(t.lost or t.unreadable) for t in disks) + len(unclear_disk),
                 measured="training finished, one line each" if not unclear_disk else "see the file"),
        FaultRow("a rank dies while recording (TP 2)", len(dead),
                 crashes=sum(bool(t["unreadable"] and not t["not_started"]) for t in dead),
                 hangs=sum(t["hang"] for t in dead), lost=sum(len(t["lost"]) for t in dead), failures=len(dead_failures),
                 measured=f"dead rank named in {sum(t['named'] for t in dead)}/{len(dead)}; slowest stop "
                          f"{max(t['stop_seconds'] for t in dead):.1f} s"),
    ]


if __name__ == "__main__":
    main()
