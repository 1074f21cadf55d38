"""The dashboard under load: several browser sessions at once on the sample traces.

The sessions are tests/faults/dashboard_sessions.py's, run as a child process: `ttrace dashboard` on a
copy of sample_traces/ (loopback), warmed (every pair's comparison once, one replay finished for the
Localize page), then one session alone (the baseline) and SESSIONS chromium sessions at once, each
visiting Runs, Heatmap, Tensor and Localize over the buggy sample pairs in turn for a bounded time. Each
visit's render time (navigation to drawn) is measured in its browser's process; this script summarizes
them per page under load and alone: p50, p95, max, and every visit that did not answer. Writes
results/dashboard_load.{md,json}.

    python benchmarks/dashboard_load.py [--sessions 4] [--seconds 120] [--work /tmp/ttrace-dashboard-load]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from fault_summary import FaultRow, write_rows
from harness import run_harness

RESULTS = Path(__file__).parent / "results"


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered) + 0.5) - 1))]


def summary(visits: list[dict], pages: list[str]) -> list[dict]:
    rows = []
    for name in [*pages, "all"]:
        of = [v for v in visits if name in (v["page"], "all")]
        answered = [v["seconds"] for v in of if v["answered"]]
        rows.append({"page": name, "visits": len(of), "answered": len(answered), "failed": len(of) - len(answered),
                     "p50_s": statistics.median(answered) if answered else None,
                     "p95_s": percentile(answered, 0.95) if answered else None,
                     "max_s": max(answered) if answered else None})
    return rows


def render(run: dict, sessions: int, seconds: float) -> str:
    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    load, alone = run["load"], run["alone"]
    lines = ["# The dashboard under load", "",
             f"`python benchmarks/dashboard_load.py --sessions {sessions} --seconds {seconds:.0f}`: `ttrace dashboard` on a "
             f"copy of sample_traces/ (loopback), {run['num_pairs']} buggy pairs; warm-up (every comparison once, one "
             f"replay) {run['warm_s']:.0f} s. Each session is its own chromium (Playwright) visiting Runs, Heatmap, Tensor "
             f"and Localize in turn; a visit answers when the page has drawn what it is for without an exception, within "
             f"{run['page_limit_s']:.0f} s. Render time is from navigation to drawn. 2 CPU cores run the server and every "
             "browser.",
             "",
             f"**{sum(not v['answered'] for v in load)} of {len(load)} visits unanswered under load** "
             f"({sum(not v['answered'] for v in alone)} of {len(alone)} alone).", "",
             f"| page | {sessions} sessions: visits | answered | p50 (s) | p95 (s) | max (s) | 1 session: visits | p50 (s) | p95 (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for under, single in zip(summary(load, run["pages"]), summary(alone, run["pages"])):
        lines.append(f"| {under['page']} | {under['visits']} | {under['answered']} | {number(under['p50_s'])} | "
                     f"{number(under['p95_s'])} | {number(under['max_s'])} | {single['visits']} | "
                     f"{number(single['p50_s'])} | {number(single['p95_s'])} |")
    failed = [v for v in [*alone, *load] if not v["answered"]]
    lines += ["", "## Every unanswered visit", ""]
    lines += [f"- session {v['session']}, {v['page']} of {v['pair']}: {v['error']}" for v in failed] or ["None."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=120.0, help="how long every session keeps visiting")
    parser.add_argument("--work", type=Path, default=Path("/tmp/ttrace-dashboard-load"))
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    run = run_harness("tests.faults.dashboard_sessions", "--sessions", str(args.sessions), "--seconds",
                      str(args.seconds), "--work", str(args.work))
    load, alone = run["load"], run["alone"]
    text = render(run, args.sessions, args.seconds)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "dashboard_load.md").write_text(text)
    (args.results / "dashboard_load.json").write_text(json.dumps(
        {"sessions": args.sessions, "seconds": args.seconds, "load": summary(load, run["pages"]),
         "alone": summary(alone, run["pages"])}, indent=1))
    overall = summary(load, run["pages"])[-1]
    write_rows(args.results, "dashboard_load", [FaultRow(
        f"dashboard, {args.sessions} browser sessions at once", len(load), failures=overall["failed"],
        crashes=sum(v["error"].startswith("exception shown") for v in load),
        hangs=sum(not v["answered"] and not v["error"].startswith("exception shown") for v in load),
        measured=f"p95 render {overall['p95_s']:.2f} s (alone {summary(alone, run['pages'])[-1]['p95_s']:.2f} s)")])
    print(text)


if __name__ == "__main__":
    main()
