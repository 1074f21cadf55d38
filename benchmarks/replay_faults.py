"""Faults in replay jobs: real localization replays of a sample pair, each hit by one fault at a random
time (the faults and the checks of a trial are tests/faults/replay_faults.py's, run as a child process:
replay killed, supervisor killed, rank crashed, replay hung, cancelled). Runs `--trials` of each, counts
the checks failed and the slowest stop. Writes results/replay_faults.{md,json}.

    python benchmarks/replay_faults.py [--trials 4] [--work /tmp/ttrace-replay-faults]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fault_summary import FaultRow, write_rows
from harness import run_harness

RESULTS = Path(__file__).parent / "results"


def render(run: dict) -> str:
    trials, pair = run["trials"], run["pair"]
    lines = ["# Faults in replay jobs", "",
             f"`python benchmarks/replay_faults.py`: the replay of `{run['module']}` for `{pair[1]}` against "
             f"`{pair[0]}` (sample traces), started as the Localize page starts it (`api.submit_replay`); uninterrupted "
             f"it takes {run['baseline_s']:.1f} s and names {run['baseline']}. Each trial strikes once, at a random "
             "time, then asks again (`rerun`).", "",
             "| fault | trials | struck mid-run | final states | marked complete | result readable | lock left | "
             "processes left | hangs | slowest stop (s) | rerun gives the verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for fault in run["faults"]:
        of = [t for t in trials if t["fault"] == fault]
        if not of:
            continue
        states = ", ".join(f"{state} {sum(t['state'] == state for t in of)}" for state in sorted({t["state"] for t in of}))
        lines.append(f"| {fault} | {len(of)} | {sum(not t['finished_before_fault'] for t in of)} | {states} | "
                     f"{sum(t['marked_complete_wrongly'] for t in of)} | "
                     f"{sum(t['result_readable_when_not_complete'] for t in of)} | {sum(t['lock_left'] for t in of)} | "
                     f"{sum(len(t['processes_left']) for t in of)} | {sum(t['hang'] for t in of)} | "
                     f"{max(t['stop_s'] for t in of):.1f} | {sum(t['rerun_same_verdict'] for t in of)} of {len(of)} |")
    bad = [t for t in trials if t["failures"]]
    lines += ["", "Marked complete: a faulted run marked complete, or a complete job without the uninterrupted verdict. "
              "Processes left: processes of the replay's process group still running once the job's final state is "
              "written (they are killed after being counted).", "", "## Every trial", "",
              "| fault | struck after (s) | final state | message | failures |", "|---|---|---|---|---|"]
    lines += [f"| {t['fault']} | {t['delay_s']:.1f} | {t['state']} | {t['message'][:140]} | "
              f"{', '.join(t['failures']) or '-'} |" for t in trials]
    lines += ["", f"**{len(bad)} of {len(trials)} trials failed a check.**"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=4, help="trials per fault")
    parser.add_argument("--work", type=Path, default=Path("/tmp/ttrace-replay-faults"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    run = run_harness("tests.faults.replay_faults", "--trials", str(args.trials), "--work", str(args.work),
                      "--seed", str(args.seed))
    text = render(run)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "replay_faults.md").write_text(text)
    (args.results / "replay_faults.json").write_text(json.dumps(
        [{name: value for name, value in t.items() if name != "failures"} for t in run["trials"]], indent=1))
    write_rows(args.results, "replay_faults", [
        FaultRow(f"replay job: {fault}", len(of), hangs=sum(t["hang"] for t in of),
                 failures=sum(bool(t["failures"]) for t in of),
                 measured=f"final states: {', '.join(sorted({t['state'] for t in of}))}; "
                          f"slowest stop {max(t['stop_s'] for t in of):.1f} s")
        for fault in run["faults"] if (of := [t for t in run["trials"] if t["fault"] == fault])])
    print(text)


if __name__ == "__main__":
    main()
