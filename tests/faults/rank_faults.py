"""A rank that dies in a multi-rank recording: the example GPT with TP 2 (`ttrace example torch-gpt
--tp 2`), one rank SIGKILLed while the other goes on. Generates the recording (`launch`), the kill
(`kill_one_rank`) and the checked trial (`RankTrial`). Used by tests/distributed/test_dead_rank.py (one
kill at a fixed point) and, as a child process, by benchmarks/recording_faults.py (random victims at
random times, `random_kills`):

    python -m tests.faults.rank_faults --work DIR --steps 4 --trials 16 --seed 1 --out trials.json

writes the uninterrupted run's seconds and every trial, with what the trace says about the dead rank.

A trial checks, against one uninterrupted run of the same command:
- the launcher stops (no hang) with one line naming the dead rank;
- every step all ranks had finished before the kill is complete and bitwise equal (no step lost);
- every step file any rank completed, the survivor's included, is bitwise equal (files consistent);
- the trace names the dead rank: it is the rank that "left no word" in its partial step file or has
  no file for the step, while the survivor's partial file says what stopped it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import h5py
import numpy as np

from ttrace_core.errors import TtraceError
from ttrace_core.record.processes import start_time_ms
from ttrace_core.format.reader import STEP_FILE, RunReader

ROOT = Path(__file__).resolve().parents[2]
WORLD_SIZE = 2
STOP_LIMIT_S = 90.0
"""A launcher still running this long after the kill is a hang."""


def launch(out: Path, steps: int, *flags: str) -> subprocess.Popen:
    """`flags`: more options of `ttrace example torch-gpt` (a smaller model for tests)."""
    command = [sys.executable, "-m", "ttrace_core", "example", "torch-gpt", "--tp", str(WORLD_SIZE),
               "--steps", str(steps), "--out", str(out), "--timeout", "300", *flags]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _command_line(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def is_rank(pid: int, parent: int) -> bool:
    """Whether `pid` (a child of `parent`) is a rank record/launch.py started: forked by the launcher itself (a
    fork carries its parent's command line), by its fork server (the server is the one whose parent does not
    carry its command line), or spawned."""
    command = _command_line(pid)
    return (FORK_SERVER in _command_line(parent) or b"spawn_main" in command
            or (command == _command_line(parent) and FORK_SERVER not in command and command != b""))


FORK_SERVER = b"multiprocessing.forkserver"


def rank_pids(launcher_pid: int, timeout_s: float = 120.0) -> list[int]:
    """The launcher's ranks, rank 0 first (they are started in rank order): the children of its fork server
    (record/launch.py), or processes it spawned."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pending, ranks = [launcher_pid], []
        while pending:
            parent = pending.pop()
            for child in _children(parent):
                pending.append(child)
                if is_rank(child, parent):
                    ranks.append(child)
        if len(ranks) == WORLD_SIZE:
            return sorted(ranks, key=lambda pid: start_time_ms(pid) or 0)
        time.sleep(0.05)
    raise TimeoutError(f"the launcher {launcher_pid} did not start {WORLD_SIZE} ranks in {timeout_s:.0f} s")


def completed_files(out: Path) -> dict[str, Path]:
    return {p.name: p for p in out.glob("rank_*.h5") if STEP_FILE.match(p.name)}


def steps_done_by_all(out: Path) -> list[int]:
    by_step: dict[int, set[int]] = {}
    for name in completed_files(out):
        match = STEP_FILE.match(name)
        by_step.setdefault(int(match.group(2)), set()).add(int(match.group(1)))
    return sorted(step for step, ranks in by_step.items() if len(ranks) == WORLD_SIZE)


def same_contents(path: Path, pristine: Path) -> bool:
    """Every dataset of `path` has the name, dtype and bytes of the uninterrupted run's."""
    def datasets(file: Path) -> dict[str, np.ndarray]:
        found: dict[str, np.ndarray] = {}
        with h5py.File(file, "r") as handle:
            handle.visititems(lambda name, node: found.__setitem__(name, node[()]) if isinstance(node, h5py.Dataset) else None)
        return found

    mine, theirs = datasets(path), datasets(pristine)
    return mine.keys() == theirs.keys() and all(
        mine[name].dtype == theirs[name].dtype and mine[name].tobytes() == theirs[name].tobytes() for name in mine)


@dataclass
class RankTrial:
    victim: int
    detail: str
    done_before: list[int] = field(default_factory=list)
    """Steps every rank had finished when the victim was killed."""
    complete: list[int] = field(default_factory=list)
    partial: dict[int, str] = field(default_factory=dict)
    lost: list[int] = field(default_factory=list)
    inconsistent_files: list[str] = field(default_factory=list)
    stop_seconds: float = 0.0
    """From the kill to the launcher's exit."""
    hang: bool = False
    error_line: str = ""
    unreadable: str = ""

    @property
    def flagged(self) -> set[int]:
        """Ranks the trace names as dead: silent in a partial step file, or without a file for the step."""
        flagged = set()
        for why in self.partial.values():
            flagged |= {rank for rank in range(WORLD_SIZE) if f"rank {rank} left no word" in why}
            if "have no file" in why:
                listed = why.split("have no file")[0].rsplit("ranks [", 1)[1].split("]")[0]
                flagged |= {int(rank) for rank in listed.split(",")}
        return flagged

    @property
    def not_started(self) -> bool:
        """Killed before the recording began (no run directory yet): nothing to lose, the launcher names the rank."""
        return "no such run directory" in self.unreadable

    @property
    def named(self) -> bool:
        """The trace names the dead rank; before the recording began, the launcher's error line does."""
        if self.not_started:
            return f"rank {self.victim} was killed by SIGKILL" in self.error_line
        if self.unreadable:
            return f"no file of rank {self.victim}" in self.unreadable
        return self.victim in self.flagged or not self.partial

    @property
    def survivors_blamed(self) -> list[int]:
        return sorted(self.flagged - {self.victim})


def kill_one_rank(out: Path, pristine: Path, steps: int, victim: int,
                  wait_for_kill: Callable[[Path, list[int]], str], flags: tuple[str, ...] = ()) -> RankTrial:
    """Record into `out` (as `pristine` was, with `flags`), SIGKILL rank `victim` once
    `wait_for_kill(out, pids)` returns (it returns how long it waited, as text), and check the trace."""
    launcher = launch(out, steps, *flags)
    try:
        pids = rank_pids(launcher.pid)
        trial = RankTrial(victim=victim, detail=wait_for_kill(out, pids))
        trial.done_before = steps_done_by_all(out)
        try:
            os.kill(pids[victim], signal.SIGKILL)
        except ProcessLookupError:
            trial.detail += " (it had already exited)"
        killed_at = time.monotonic()
        try:
            _, stderr = launcher.communicate(timeout=STOP_LIMIT_S)
        except subprocess.TimeoutExpired:
            trial.hang = True
            os.killpg(launcher.pid, signal.SIGKILL)
            _, stderr = launcher.communicate()
        trial.stop_seconds = time.monotonic() - killed_at
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate()
    lines = stderr.strip().splitlines()
    trial.error_line = lines[-1] if lines else ""
    return checked(trial, out, pristine)


def checked(trial: RankTrial, out: Path, pristine: Path) -> RankTrial:
    try:
        with RunReader(out) as reader:
            trial.complete, trial.partial = list(reader.complete_steps), dict(reader.partial_steps)
    except TtraceError as error:
        trial.unreadable = str(error)
    pristine_files = completed_files(pristine)
    trial.inconsistent_files = sorted(name for name, path in completed_files(out).items()
                                      if not same_contents(path, pristine_files[name]))
    differing = {int(STEP_FILE.match(name).group(2)) for name in trial.inconsistent_files}
    trial.lost = [step for step in trial.done_before if step not in trial.complete or step in differing]
    return trial


def random_kills(work: Path, steps: int, count: int, rng: random.Random) -> tuple[list[RankTrial], float]:
    """`count` trials, each killing a random rank at a random time; and the seconds the ranks of an
    uninterrupted run take from their start to the launcher's exit (the span the kill times are drawn from)."""
    pristine = work / "tp2-pristine"
    shutil.rmtree(pristine, ignore_errors=True)
    launcher = launch(pristine, steps)
    rank_pids(launcher.pid)
    started = time.monotonic()
    _, stderr = launcher.communicate(timeout=600)
    seconds = time.monotonic() - started
    assert launcher.returncode == 0, stderr

    def after_random_delay(out: Path, pids: list[int]) -> str:
        delay = rng.uniform(0.0, 0.9 * seconds)  # the ranks exit a little before their launcher
        time.sleep(delay)
        return f"rank {victim} after {delay:.2f} s"

    trials = []
    for index in range(count):
        out = work / f"dead-rank-{index}"
        shutil.rmtree(out, ignore_errors=True)
        victim = rng.randrange(WORLD_SIZE)
        trials.append(kill_one_rank(out, pristine, steps, victim, after_random_delay))
        shutil.rmtree(out, ignore_errors=True)
    return trials, seconds


def record_of(trial: RankTrial) -> dict:
    """A trial as JSON, with what the trace says about the dead rank."""
    return {**asdict(trial), "flagged": sorted(trial.flagged), "named": trial.named, "not_started": trial.not_started,
            "survivors_blamed": trial.survivors_blamed}


def main() -> None:
    parser = argparse.ArgumentParser(description="A random rank of a TP 2 recording SIGKILLed at a random time, checked.")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True, help="JSON: the uninterrupted run's seconds and every trial")
    args = parser.parse_args()
    trials, seconds = random_kills(args.work, args.steps, args.trials, random.Random(args.seed))
    args.out.write_text(json.dumps({"seconds": seconds, "stop_limit_s": STOP_LIMIT_S,
                                    "trials": [record_of(trial) for trial in trials]}))


if __name__ == "__main__":
    main()
