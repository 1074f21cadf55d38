"""The dashboard under load: several browser sessions at once on the sample traces.

Serves a copy of sample_traces/ with `ttrace dashboard` on loopback, warms it (every pair's
comparison computed once, one replay finished for the Localize page), then runs SESSIONS chromium
sessions at once (Playwright, one process each), each visiting the four pages (Runs, Heatmap,
Tensor, Localize) over the buggy sample pairs in turn for a bounded time. A visit answers when the
page has drawn what it is for (the heatmap's cells, the tensor page's shard map, the replay's verdict)
without an exception, within PAGE_LIMIT_S. The same loop with one session is the baseline. Writes
results/dashboard_load.{md,json}.

    python benchmarks/dashboard_load.py [--sessions 4] [--seconds 120] [--work /tmp/ttrace-dashboard-load]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import time
import urllib.parse
from dataclasses import asdict, dataclass
from pathlib import Path

from dashboard import CHROMIUM, IDLE, free_port, start_dashboard, stop_dashboard
from fault_summary import FaultRow, write_rows

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
PAGE_LIMIT_S = 120.0
SAMPLES = json.loads((ROOT / "sample_traces" / "samples.json").read_text())
PAIRS = [s for s in SAMPLES if s.get("expected_exit") == 1 and s.get("first_divergence")]
REPLAYED = PAIRS[0]
"""The pair whose first-divergence module is replayed during the warm-up (the Localize page shows it)."""


@dataclass
class Visit:
    session: int
    page: str
    pair: str
    seconds: float
    answered: bool
    error: str = ""


def _query(sample: dict, **extra: str) -> str:
    return urllib.parse.urlencode({"ref": sample["reference"], "cand": sample["name"], **extra})


def _tensor_id(sample: dict) -> str:
    first = sample["first_divergence"]
    return f"{first['phase']}/{first['fqn']}/{first['slot']}"


PAGES = {
    # page -> (path and query for a sample, the JavaScript test that says it has drawn)
    "runs": (lambda s: f"/runs?{_query(s)}",
             "[...document.querySelectorAll('a')].some(a => a.innerText.includes('Open the heatmap'))"),
    "heatmap": (lambda s: f"/heatmap?{_query(s)}",
                "document.querySelector('.js-plotly-plot .scatterlayer path.point') !== null"),
    "tensor": (lambda s: f"/tensor?{_query(s, tensor=_tensor_id(s))}",
               "document.body.innerText.includes('Shard map') && document.querySelectorAll('.js-plotly-plot').length >= 3"),
    "localize": (lambda s: f"/localize?{_query(REPLAYED, module=REPLAYED['first_divergence']['fqn'])}",
                 "document.body.innerText.includes('Culprit (introduces the error)')"),
}


def visit(page, base: str, name: str, sample: dict) -> tuple[float, str]:
    """Seconds from navigation to the page drawn, and the error ('' when it answered)."""
    path, drawn = PAGES[name]
    started = time.perf_counter()
    try:
        page.goto(base + path(sample), timeout=PAGE_LIMIT_S * 1000)
        page.wait_for_function(f"""() => document.querySelector('[data-testid=stException]') !== null
            || (document.querySelector('{IDLE}') !== null && ({drawn}))""", timeout=PAGE_LIMIT_S * 1000, polling=50)
    except Exception as error:  # a Playwright timeout or a navigation failure: the page did not answer
        return time.perf_counter() - started, f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    exception = page.locator("[data-testid=stException]")
    if exception.count():
        return time.perf_counter() - started, "exception shown: " + exception.first.inner_text()[:160]
    return time.perf_counter() - started, ""


def session(index: int, base: str, seconds: float, max_visits: int, out: Path) -> None:
    """One browser session's loop: every page over every pair in turn, until time or visits run out."""
    from playwright.sync_api import sync_playwright

    visits = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_context(viewport={"width": 1400, "height": 1200}).new_page()
        deadline = time.monotonic() + seconds
        turn = index  # sessions start at different pages, so every page is under load at once
        while time.monotonic() < deadline and len(visits) < max_visits:
            name = list(PAGES)[turn % len(PAGES)]
            sample = PAIRS[(turn // len(PAGES)) % len(PAIRS)]
            took, error = visit(page, base, name, sample)
            visits.append(Visit(index, name, sample["name"], took, not error, error))
            turn += 1
        browser.close()
    out.write_text(json.dumps([asdict(v) for v in visits]))


def run_sessions(base: str, count: int, seconds: float, max_visits: int, work: Path) -> list[Visit]:
    context = multiprocessing.get_context("spawn")
    outs = [work / f"session-{count}-{i}.json" for i in range(count)]
    processes = [context.Process(target=session, args=(i, base, seconds, max_visits, out)) for i, out in enumerate(outs)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=seconds + 2 * PAGE_LIMIT_S + 60)
        if process.is_alive():
            process.kill()
            process.join()
    visits = []
    for index, out in enumerate(outs):
        if out.exists():
            visits += [Visit(**v) for v in json.loads(out.read_text())]
        else:  # the session itself died or hung: every page it would have visited counts as unanswered
            visits.append(Visit(index, "session", "-", 0.0, False, "the browser session did not finish"))
    return visits


def warm_up(root: Path, base: str, pairs: list[dict] | None = None) -> float:
    """Every pair's comparison once (cached for all sessions; `pairs`: only these) and the Localize page's replay."""
    from playwright.sync_api import sync_playwright

    from ttrace_core import api

    started = time.monotonic()
    job = api.submit_replay(root / REPLAYED["reference"], root / REPLAYED["name"], REPLAYED["first_divergence"]["fqn"])
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page()
        for sample in PAIRS if pairs is None else pairs:
            _, error = visit(page, base, "heatmap", sample)
            assert not error, f"warm-up of {sample['name']}: {error}"
        browser.close()
    assert job.wait(timeout_s=600).state == "complete", job.log_tail()
    return time.monotonic() - started


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


def serve(work: Path):
    root = work / "sample_traces"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(ROOT / "sample_traces", root, ignore=shutil.ignore_patterns(".ttrace"))
    port = free_port()
    server = start_dashboard(root, port, work / "dashboard.log")
    return root, f"http://127.0.0.1:{port}", server


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
