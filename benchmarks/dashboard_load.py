"""The dashboard under load: several browser sessions at once on the sample traces.

The sessions are tests/faults/dashboard_sessions.py's: `ttrace dashboard` on a copy of
sample_traces/ (loopback), warmed (every pair's comparison once, one replay finished for the Localize
page), then SESSIONS chromium sessions at once, each visiting Runs, Heatmap, Tensor and Localize over
the buggy sample pairs in turn for a bounded time. This script measures render time (navigation to
drawn) per page under load and with one session alone (the baseline): p50, p95, max, and every
visit that did not answer. Writes results/dashboard_load.{md,json}.

    python benchmarks/dashboard_load.py [--sessions 4] [--seconds 120] [--work /tmp/ttrace-dashboard-load]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from fault_summary import FaultRow, write_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's tests/ package, where the sessions live
from tests.faults.dashboard_sessions import (  # noqa: E402
    PAGE_LIMIT_S, PAGES, PAIRS, Visit, run_sessions, serve, stop_dashboard, warm_up)

RESULTS = Path(__file__).parent / "results"


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered) + 0.5) - 1))]


def summary(visits: list[Visit]) -> list[dict]:
    rows = []
    for name in [*PAGES, "all"]:
        of = [v for v in visits if name in (v.page, "all")]
        answered = [v.seconds for v in of if v.answered]
        rows.append({"page": name, "visits": len(of), "answered": len(answered), "failed": len(of) - len(answered),
                     "p50_s": statistics.median(answered) if answered else None,
                     "p95_s": percentile(answered, 0.95) if answered else None,
                     "max_s": max(answered) if answered else None})
    return rows


def render(load: list[Visit], alone: list[Visit], sessions: int, seconds: float, warm_s: float) -> str:
    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = ["# The dashboard under load", "",
             f"`python benchmarks/dashboard_load.py --sessions {sessions} --seconds {seconds:.0f}`: `ttrace dashboard` on a "
             f"copy of sample_traces/ (loopback), {len(PAIRS)} buggy pairs; warm-up (every comparison once, one replay) "
             f"{warm_s:.0f} s. Each session is its own chromium (Playwright) visiting Runs, Heatmap, Tensor and Localize in "
             f"turn; a visit answers when the page has drawn what it is for without an exception, within "
             f"{PAGE_LIMIT_S:.0f} s. Render time is from navigation to drawn. 2 CPU cores run the server and every browser.",
             "",
             f"**{sum(not v.answered for v in load)} of {len(load)} visits unanswered under load** "
             f"({sum(not v.answered for v in alone)} of {len(alone)} alone).", "",
             f"| page | {sessions} sessions: visits | answered | p50 (s) | p95 (s) | max (s) | 1 session: visits | p50 (s) | p95 (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for under, single in zip(summary(load), summary(alone)):
        lines.append(f"| {under['page']} | {under['visits']} | {under['answered']} | {number(under['p50_s'])} | "
                     f"{number(under['p95_s'])} | {number(under['max_s'])} | {single['visits']} | "
                     f"{number(single['p50_s'])} | {number(single['p95_s'])} |")
    failed = [v for v in [*alone, *load] if not v.answered]
    lines += ["", "## Every unanswered visit", ""]
    lines += [f"- session {v.session}, {v.page} of {v.pair}: {v.error}" for v in failed] or ["None."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=120.0, help="how long every session keeps visiting")
    parser.add_argument("--work", type=Path, default=Path("/tmp/ttrace-dashboard-load"))
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root, base, server = serve(args.work)
    try:
        warm_s = warm_up(root, base)
        alone = run_sessions(base, 1, args.seconds / 2, 10_000, args.work)
        load = run_sessions(base, args.sessions, args.seconds, 10_000, args.work)
    finally:
        stop_dashboard(server)
    text = render(load, alone, args.sessions, args.seconds, warm_s)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "dashboard_load.md").write_text(text)
    (args.results / "dashboard_load.json").write_text(json.dumps(
        {"sessions": args.sessions, "seconds": args.seconds, "load": summary(load), "alone": summary(alone)}, indent=1))
    overall = summary(load)[-1]
    write_rows(args.results, "dashboard_load", [FaultRow(
        f"dashboard, {args.sessions} browser sessions at once", len(load), failures=overall["failed"],
        crashes=sum(v.error.startswith("exception shown") for v in load),
        hangs=sum(not v.answered and not v.error.startswith("exception shown") for v in load),
        measured=f"p95 render {overall['p95_s']:.2f} s (alone {summary(alone)[-1]['p95_s']:.2f} s)")])
    print(text)


if __name__ == "__main__":
    main()
