"""The replay-fault harness: real localization replays (`api.submit_replay`, as the dashboard's Localize
page starts them) of a sample pair, each hit by one fault at a given time:

- replay killed: the `ttrace localize` command SIGKILLed;
- supervisor killed: the job's supervisor SIGKILLed (the page notices on its next poll);
- rank crashed: one of the replay's ranks SIGKILLed;
- replay hung: every process of the replay frozen (SIGSTOP), under a 20 s job timeout;
- cancelled: the page's Cancel button (`Job.cancel`).

`run_trial` strikes once and checks that the job is never marked complete by a faulted run (a replay
that finished before the fault struck must carry the uninterrupted run's verdict), that no result is
readable unless complete, that the lock is released, that no process of the replay is left running,
and that asking again (`rerun`) runs a fresh replay to the uninterrupted run's verdict; `failures`
names the checks a trial failed.

Used by tests/test_replay_faults.py (one fixed fault) and, as a child process, by
benchmarks/replay_faults.py (every fault at random times, its tables and results/replay_faults.{md,json}):

    python -m tests.faults.replay_faults --trials 4 --work /tmp/ttrace-replay-faults --seed 0 --out trials.json

writes the uninterrupted replay's seconds and culprits and every trial, with the checks it failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from ttrace_core import api
from ttrace_core.service.jobs import Job
from tests.faults.rank_faults import is_rank

ROOT = Path(__file__).resolve().parents[2]
PAIR = ("fp32/reference", "fp32/tp2_row_parallel_bias")
MODULE = "decoder.layers.0"
HUNG_JOB_TIMEOUT_S = 20.0
STOP_LIMIT_S = 120.0


def _live_processes() -> dict[int, tuple[int, int]]:
    """Every live (not zombie) process: pid -> (parent pid, process group), through psutil, as
    record/processes.py reads liveness."""
    found = {}
    for process in psutil.process_iter(["ppid", "status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE:
                found[process.pid] = (process.info["ppid"], os.getpgid(process.pid))
        except (psutil.Error, OSError):
            continue
    return found


def processes_of_group(pgid: int) -> list[int]:
    return [pid for pid, (_, group) in _live_processes().items() if group == pgid]


def replay_groups(pgid: int) -> set[int]:
    """The process groups of a replay: the `ttrace localize` command's, and those of the processes it started.
    A run recorded as a command (`ttrace record`, `ttrace example`) is relaunched in a session of its own, so its
    ranks are not in the command's group."""
    live = _live_processes()
    found, frontier = {pgid}, [pid for pid, (_, group) in live.items() if group == pgid]
    while frontier:
        children = [pid for pid, (parent, _) in live.items() if parent in frontier]
        found |= {live[pid][1] for pid in children}
        frontier = children
    return found


def rank_pids(pgid: int) -> list[int]:
    ranks = []
    for group in replay_groups(pgid):
        for pid in processes_of_group(group):
            try:
                if is_rank(pid, psutil.Process(pid).ppid()):
                    ranks.append(pid)
            except psutil.Error:
                pass
    return ranks


@dataclass
class ReplayTrial:
    fault: str
    delay_s: float
    state: str = ""
    message: str = ""
    finished_before_fault: bool = False
    marked_complete_wrongly: bool = False
    result_readable_when_not_complete: bool = False
    lock_left: bool = False
    processes_left: list[int] = field(default_factory=list)
    hang: bool = False
    stop_s: float = 0.0
    rerun_state: str = ""
    rerun_same_verdict: bool = False


def _command_pid(job: Job, deadline: float) -> int:
    while (status := job.status()).command is None:
        assert time.monotonic() < deadline and not status.done, f"{job.directory}: the replay never started"
        time.sleep(0.02)
    return status.command.pid


def _strike(fault: str, job: Job, pgid: int) -> None:
    status = job.status()
    if fault == "replay killed":
        os.kill(pgid, signal.SIGKILL)
    elif fault == "supervisor killed":
        os.kill(status.supervisor.pid, signal.SIGKILL)
    elif fault == "rank crashed":
        os.kill(rank_pids(pgid)[-1], signal.SIGKILL)
    elif fault == "replay hung":
        os.killpg(pgid, signal.SIGSTOP)
    elif fault == "cancelled":
        job.cancel()


def _wait_until_ranks_run(pgid: int, deadline: float) -> None:
    while not rank_pids(pgid):
        assert time.monotonic() < deadline, "the replay never started its ranks"
        time.sleep(0.02)


def run_trial(fault: str, delay_s: float, pair: tuple[Path, Path], baseline: list[str]) -> ReplayTrial:
    trial = ReplayTrial(fault=fault, delay_s=delay_s)
    job_timeout = HUNG_JOB_TIMEOUT_S if fault == "replay hung" else None
    job = api.submit_replay(*pair, MODULE, rerun=True, timeout_s=600, job_timeout_s=job_timeout)
    deadline = time.monotonic() + STOP_LIMIT_S
    pgid = _command_pid(job, deadline)
    if fault in ("rank crashed", "replay hung"):
        _wait_until_ranks_run(pgid, deadline)
    time.sleep(delay_s)
    if fault == "rank crashed":  # a rank of the replay running then: ranks forked without imports end in a second
        while not rank_pids(pgid) and not job.status().done:
            assert time.monotonic() < deadline, "the replay's ranks never started again"
            time.sleep(0.01)
    trial.finished_before_fault = job.status().done
    groups = replay_groups(pgid)  # before the strike: a killed command's children leave its process tree
    if not trial.finished_before_fault:
        _strike(fault, job, pgid)
    struck = time.monotonic()
    try:
        status = job.wait(timeout_s=STOP_LIMIT_S)
    except TimeoutError:
        trial.hang, status = True, job.status()
    trial.stop_s = time.monotonic() - struck
    trial.state, trial.message = status.state, status.message
    result = api.localization(job) if status.state == "complete" else None
    trial.marked_complete_wrongly = status.state == "complete" and (
        not trial.finished_before_fault or result is None or result.culprits != baseline)
    trial.result_readable_when_not_complete = status.state != "complete" and job.result() is not None
    time.sleep(0.5)
    trial.lock_left = (job.directory / "lock").exists()
    trial.processes_left = [pid for group in groups | replay_groups(pgid) for pid in processes_of_group(group)]
    for pid in trial.processes_left:  # never leave them behind, even when counted
        os.kill(pid, signal.SIGKILL)
    again = api.submit_replay(*pair, MODULE, rerun=True)
    trial.rerun_state = again.wait(timeout_s=600).state
    rerun = api.localization(again) if trial.rerun_state == "complete" else None
    trial.rerun_same_verdict = rerun is not None and rerun.culprits == baseline
    return trial


def failures(trial: ReplayTrial) -> list[str]:
    found = []
    for name, bad in (("marked complete", trial.marked_complete_wrongly),
                      ("result readable", trial.result_readable_when_not_complete), ("lock left", trial.lock_left),
                      ("processes left", bool(trial.processes_left)), ("hang", trial.hang),
                      ("rerun failed", not trial.rerun_same_verdict)):
        if bad:
            found.append(name)
    return found


FAULTS = ("replay killed", "supervisor killed", "rank crashed", "replay hung", "cancelled")


def copied_pair(work: Path) -> tuple[Path, Path]:
    """The sample pair copied: replay jobs write under the candidate (`.ttrace/jobs`)."""
    pair = []
    for name in PAIR:
        target = work / name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(ROOT / "sample_traces" / name, target, ignore=shutil.ignore_patterns(".ttrace"))
        pair.append(target)
    return pair[0], pair[1]


def main() -> None:
    parser = argparse.ArgumentParser(description="Every fault struck at random times into replays of the sample pair.")
    parser.add_argument("--trials", type=int, default=4, help="trials per fault")
    parser.add_argument("--work", type=Path, default=Path("/tmp/ttrace-replay-faults"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="JSON: the uninterrupted replay and every trial")
    args = parser.parse_args()
    pair = copied_pair(args.work)
    started = time.monotonic()
    job = api.submit_replay(*pair, MODULE, rerun=True)
    assert job.wait(timeout_s=600).state == "complete", job.log_tail()
    baseline_s, baseline = time.monotonic() - started, api.localization(job).culprits
    rng = random.Random(args.seed)
    trials = []
    for index in range(args.trials):
        for fault in FAULTS:
            trial = run_trial(fault, rng.uniform(0.0, baseline_s * 0.9), pair, baseline)
            print(f"{fault} #{index}: {trial.state} after {trial.delay_s:.1f} s; failures: {failures(trial) or 'none'}",
                  flush=True)
            trials.append({**asdict(trial), "failures": failures(trial)})
    args.out.write_text(json.dumps({"module": MODULE, "pair": PAIR, "faults": FAULTS, "baseline_s": baseline_s,
                                    "baseline": baseline, "trials": trials}))


if __name__ == "__main__":
    main()
