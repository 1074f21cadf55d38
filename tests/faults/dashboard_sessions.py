"""The dashboard-load session driver: `ttrace dashboard` served on a copy of sample_traces/, and
browser sessions at once that visit its pages.

Generates: a served copy of the sample traces (`serve`, with `start_dashboard`/`stop_dashboard`:
`ttrace dashboard` in its own process group, once healthy), its warm-up (`warm_up`: every buggy
pair's comparison computed once, one replay finished for the Localize page), and `run_sessions`:
chromium sessions at once (Playwright, one process each), each visiting the four pages (Runs,
Heatmap, Tensor, Localize) over the buggy sample pairs in turn, for a bounded time or number of
visits. A visit answers when the page has drawn what it is for (the heatmap's cells, the tensor
page's shard map, the replay's verdict) without an exception, within PAGE_LIMIT_S; each `Visit`
carries its seconds and its error.

Used by tests/app/test_dashboard_load.py (two sessions, one visit per page each) and, as a child
process, by benchmarks/dashboard_load.py (many sessions for minutes; render-time percentiles,
results/dashboard_load.*):

    python -m tests.faults.dashboard_sessions --sessions 4 --seconds 120 --work DIR --out visits.json

serves, warms up, runs one session alone for half the time, then the sessions at once, and writes every
visit with its seconds (measured in the browser's process, from navigation to drawn).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from ttrace_core.record.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
IDLE = "[data-test-script-state=notRunning]"
"""Streamlit marks the page so when its script has finished running."""
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


def start_dashboard(root: Path, port: int, log: Path) -> subprocess.Popen:
    """`ttrace dashboard ROOT` in its own process group (it spawns `streamlit run`), once healthy."""
    server = subprocess.Popen(["ttrace", "dashboard", str(root), "--port", str(port)], stdout=log.open("w"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"ttrace dashboard exited with {server.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as response:
                if response.read().strip() == b"ok":
                    return server
        except OSError:
            pass
        time.sleep(0.2)
    stop_dashboard(server)
    raise RuntimeError(f"ttrace dashboard not healthy on port {port} after 60 s; see {log}")


def stop_dashboard(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def serve(work: Path):
    root = work / "sample_traces"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(ROOT / "sample_traces", root, ignore=shutil.ignore_patterns(".ttrace"))
    port = free_port()
    server = start_dashboard(root, port, work / "dashboard.log")
    return root, f"http://127.0.0.1:{port}", server


def main() -> None:
    parser = argparse.ArgumentParser(description="Browser sessions on `ttrace dashboard`: one alone, then many at once.")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=120.0, help="how long every session keeps visiting")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="JSON: the warm-up's seconds and every visit")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    root, base, server = serve(args.work)
    try:
        warm_s = warm_up(root, base)
        alone = run_sessions(base, 1, args.seconds / 2, 10_000, args.work)
        load = run_sessions(base, args.sessions, args.seconds, 10_000, args.work)
    finally:
        stop_dashboard(server)
    args.out.write_text(json.dumps({"warm_s": warm_s, "page_limit_s": PAGE_LIMIT_S, "pages": list(PAGES),
                                    "num_pairs": len(PAIRS), "alone": [asdict(v) for v in alone],
                                    "load": [asdict(v) for v in load]}))


if __name__ == "__main__":
    main()
