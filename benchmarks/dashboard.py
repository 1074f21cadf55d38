"""Dashboard latency on a 48-layer Megatron GPT: first comparison, cached heatmap, cell click to tensor view.

Records (or reuses) a reference (tp 1) and a candidate (tp 2 with the row-parallel-bias-per-rank
bug) under --workdir, serves them with `ttrace dashboard`, and drives the pages in Debian's
chromium through Playwright: the first comparison (CAND/.ttrace deleted; a streamed job, timed to
the first divergence drawn and to the whole page), the heatmap once the comparison is cached (a cold
page load, and from the Runs page), the timeline's section opened until it is drawn, and a click on
the first-divergence cell until the tensor page has drawn.
The tensor page's server-side work (`api.comparison_table` from the cache + `api.tensor_view`) is
also timed in this process, and so is opening each run's index (`RunReader`). Prints a table and
writes results/dashboard.md.

    python benchmarks/dashboard.py [--workdir /tmp/ttrace-bench-dashboard] [--repeats 3] [--num-layers 48]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import plotly
import plotly.offline
from playwright.sync_api import Page, sync_playwright

from ttrace_core import api
from ttrace_core.errors import TtraceError
from ttrace_core.format.reader import RunReader
from ttrace_core.record.launch import free_port
from ttrace_dashboard import cells, step_view
from ttrace_dashboard.state import ALL_MICRO_BATCHES, default_rows

RESULTS = Path(__file__).parent / "results"
CHROMIUM = "/usr/bin/chromium"
IDLE = "[data-test-script-state=notRunning]"
"""Streamlit marks the page so when its script has finished running."""
NUM_LAYERS = 48
RUNS = {  # run directory name -> extra flags of `ttrace example megatron-gpt`
    "ref": [],
    "cand": ["--tp", "2", "--bug", "row-parallel-bias-per-rank"],
}
NUM_TENSOR_CHARTS = 5
"""The tensor page draws shard map, per rank, |difference|, histogram and history; the heatmap page one, and the
timeline once its section is opened."""
TIMELINE_LABEL = "Timeline: every tensor of the step"
PAGE_TIMEOUT_MS = 900_000
"""Generous: on 2 shared cores a 48-layer heatmap takes a minute or more to draw."""
HEATMAP_GOAL_S = 1.5
FIRST_PICTURE_GOAL_S = 5.0
WHOLE_HEATMAP_GOAL_S = 10.0
TENSOR_SERVER_GOAL_S = 0.5


@dataclass(kw_only=True, slots=True)
class Measure:
    name: str
    value: str
    goal: str = "-"
    met: bool | None = None
    """None when the measure has no goal."""


def record(workdir: Path, num_layers: int) -> dict[str, float | None]:
    """Record every run missing a complete step; seconds per run, None for a reused one."""
    seconds: dict[str, float | None] = {}
    for name, flags in RUNS.items():
        run_dir = workdir / name
        if _complete(run_dir):
            seconds[name] = None
            continue
        shutil.rmtree(run_dir, ignore_errors=True)
        command = [sys.executable, "-m", "ttrace_core", "example", "megatron-gpt", "--num-layers", str(num_layers),
                   "--steps", "1", *flags, "--out", str(run_dir)]
        started = time.perf_counter()
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        seconds[name] = time.perf_counter() - started
    return seconds


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


def _complete(run_dir: Path) -> bool:
    try:
        with RunReader(run_dir) as reader:
            return bool(reader.complete_steps) and not reader.partial_steps
    except (TtraceError, OSError):
        return False


def _median_seconds(action: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _open_index(run_dir: Path) -> int:
    with RunReader(run_dir) as reader:
        return len(reader.index)


def _trace_mib(run_dir: Path) -> float:
    return sum(p.stat().st_size for p in run_dir.glob("*.h5")) / 2**20


def _drawn(page: Page, num_charts: int, timeout_ms: int, *, markers: bool) -> None:
    """Wait until the script is idle with `num_charts` plotly charts drawn (with scatter markers when
    `markers`: the heatmap's cells); fail at once on a shown exception."""
    marker_test = "document.querySelector('.js-plotly-plot .scatterlayer path.point') !== null" if markers else "true"
    page.wait_for_function(f"""() => document.querySelector('[data-testid=stException]') !== null
        || (document.querySelector('{IDLE}') !== null
            && document.querySelectorAll('.js-plotly-plot').length >= {num_charts} && {marker_test})""",
                           timeout=timeout_ms, polling=50)
    exception = page.locator("[data-testid=stException]")
    if exception.count():
        raise RuntimeError(f"{page.url}: the page shows an exception: {exception.first.inner_text()[:500]}")


def time_heatmap(page: Page, url: str, timeout_ms: int) -> float:
    started = time.perf_counter()
    page.goto(url)
    _drawn(page, 1, timeout_ms, markers=True)
    return time.perf_counter() - started


def time_first_comparison(page: Page, url: str, timeout_ms: int) -> tuple[float, float]:
    """The first comparison, streamed: seconds from goto to the first useful picture (the first divergence
    banner and the heatmap of the rows compared so far), and to the whole page (heatmap and timeline)."""
    started = time.perf_counter()
    page.goto(url)
    page.wait_for_function("""() => document.querySelector('[data-testid=stException]') !== null
        || ([...document.querySelectorAll('[data-testid=stAlert], [data-testid=stAlertContainer]')]
                .some(e => e.innerText.includes('First divergence'))
            && document.querySelector('.js-plotly-plot .scatterlayer path.point') !== null)""",
                           timeout=timeout_ms, polling=50)
    first_picture_s = time.perf_counter() - started
    page.get_by_text(TIMELINE_LABEL).wait_for(timeout=timeout_ms)  # only the whole page has the timeline's section
    _drawn(page, 1, timeout_ms, markers=True)
    return first_picture_s, time.perf_counter() - started


def time_open_timeline(page: Page, timeout_ms: int) -> float:
    """On a drawn heatmap page: a click on the timeline's section until the timeline is drawn beside the heatmap."""
    started = time.perf_counter()
    page.get_by_text(TIMELINE_LABEL).click()
    _drawn(page, 2, timeout_ms, markers=True)
    return time.perf_counter() - started


def time_message_page(page: Page, base: str) -> float:
    """Streamlit's own floor: a cold load of a page that only shows a message (no pair, no chart)."""
    started = time.perf_counter()
    page.goto(f"{base}/heatmap")
    page.wait_for_selector("[data-testid=stAlert], [data-testid=stAlertContainer]", timeout=PAGE_TIMEOUT_MS)
    return time.perf_counter() - started


def time_open_heatmap_in_app(page: Page, base: str) -> float:
    """In the loaded app: the Runs page's "Open the heatmap" button to a drawn heatmap."""
    page.goto(f"{base}/runs?" + urllib.parse.urlencode({"ref": "ref", "cand": "cand"}))
    button = page.get_by_role("link", name="Open the heatmap")
    button.wait_for(timeout=PAGE_TIMEOUT_MS)
    page.wait_for_selector(IDLE, timeout=PAGE_TIMEOUT_MS)
    started = time.perf_counter()
    button.click()
    page.wait_for_function("() => location.pathname.endsWith('/heatmap')", timeout=PAGE_TIMEOUT_MS, polling=50)
    _drawn(page, 1, PAGE_TIMEOUT_MS, markers=True)
    return time.perf_counter() - started


def click_first_divergence(page: Page) -> tuple[float, str]:
    """Click the heatmap's outlined first-divergence cell (else its first cell); seconds to the drawn tensor page."""
    heatmap = page.locator(".js-plotly-plot").first
    marker = heatmap.locator(".scatterlayer .trace").last.locator("path.point").first
    marker.scroll_into_view_if_needed()
    box = marker.bounding_box()
    started = time.perf_counter()
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.wait_for_function("() => location.href.includes('tensor=')", timeout=PAGE_TIMEOUT_MS, polling=50)
    _drawn(page, NUM_TENSOR_CHARTS, PAGE_TIMEOUT_MS, markers=False)
    seconds = time.perf_counter() - started
    return seconds, urllib.parse.parse_qs(urllib.parse.urlparse(page.url).query)["tensor"][0]


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def browse(base: str, candidate: Path, repeats: int) -> dict:
    """The browser measures. Each first comparison starts with the comparison cache under the candidate deleted."""
    url = f"{base}/heatmap?" + urllib.parse.urlencode({"ref": "ref", "cand": "cand"})
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            context = browser.new_context(viewport={"width": 1600, "height": 1200})
            first_picture_s, first_s, job_warm = [], [], []
            for _ in range(repeats):
                shutil.rmtree(candidate / ".ttrace", ignore_errors=True)
                page = context.new_page()
                picture, whole = time_first_comparison(page, url, PAGE_TIMEOUT_MS)
                page.close()
                first_picture_s.append(picture), first_s.append(whole)
                _progress(f"first comparison: first divergence drawn {picture:.1f} s, whole heatmap {whole:.1f} s")
                job_warm += [json.loads(status.read_text()).get("warm", False)
                             for status in (candidate / ".ttrace").rglob("status.json")]
            cached, timeline = [], []
            for _ in range(repeats):
                page = context.new_page()
                cached.append(time_heatmap(page, url, PAGE_TIMEOUT_MS))
                num_markers = page.locator(".js-plotly-plot").first.locator(".scatterlayer path.point").count()
                timeline.append(time_open_timeline(page, PAGE_TIMEOUT_MS))
                _progress(f"cached heatmap -> drawn: {cached[-1]:.2f} s; timeline opened -> drawn: {timeline[-1]:.2f} s")
                page.close()
            floor, in_app = [], []
            for _ in range(repeats):
                page = context.new_page()
                floor.append(time_message_page(page, base))
                page.close()
                page = context.new_page()
                in_app.append(time_open_heatmap_in_app(page, base))
                _progress(f"message page: {floor[-1]:.2f} s; Runs -> Open the heatmap -> drawn: {in_app[-1]:.2f} s")
                page.close()
            page = context.new_page()
            time_heatmap(page, url, PAGE_TIMEOUT_MS)
            click_s, tensor = click_first_divergence(page)
            _progress(f"click -> drawn tensor page ({tensor}): {click_s:.2f} s")
        finally:
            browser.close()
    return {"first_picture_s": first_picture_s, "first_s": first_s, "cached_s": cached, "num_markers": num_markers, "click_s": click_s, "tensor": tensor,
            "floor_s": floor, "in_app_s": in_app, "job_warm": job_warm, "timeline_s": timeline}


def tensor_server_seconds(reference: Path, candidate: Path, tensor: str, repeats: int) -> dict[str, float | int]:
    """The tensor page's server-side work in this process: the cached table, then one tensor's view."""
    frame = api.comparison_table(reference, candidate).frame
    row = frame[frame["tensor"] == tensor].sort_values(["step", "micro_batch"]).iloc[0]
    step, micro_batch = int(row["step"]), int(row["micro_batch"])
    table_s = _median_seconds(lambda: api.comparison_table(reference, candidate), repeats)
    view_s = _median_seconds(lambda: api.tensor_view(reference, candidate, tensor, step, micro_batch), repeats)
    both_s = _median_seconds(lambda: (api.comparison_table(reference, candidate),
                                      api.tensor_view(reference, candidate, tensor, step, micro_batch)), repeats)
    return {"table_s": table_s, "view_s": view_s, "both_s": both_s, "num_rows": len(frame)}


def _page_view(reference: Path, candidate: Path) -> tuple:
    """The cached table, and the step and rows the heatmap page opens on (`state.default_rows`)."""
    frame = api.comparison_table(reference, candidate).frame
    first = cells.first_divergence(frame)
    step = int(first["step"]) if first is not None else int(frame["step"].min())
    return frame, step, default_rows(frame["module"].nunique())


def heatmap_server_seconds(reference: Path, candidate: Path, repeats: int) -> dict[str, float]:
    """The heatmap page's own work in this process, the first time a step is shown (later visits reuse it from
    Streamlit's resource cache): the cached table and the step's view (cells, rows, heatmap figure) serialized;
    and the timeline, built when its section is opened."""
    def view() -> None:
        frame, step, rows = _page_view(reference, candidate)
        step_view.step_view(frame, step, ALL_MICRO_BATCHES, rows, None).heatmap.to_json()

    def timeline() -> None:
        frame, step, _ = _page_view(reference, candidate)
        step_view.step_timeline(frame, step).to_json()

    return {"view_s": _median_seconds(view, repeats), "timeline_s": _median_seconds(timeline, repeats)}


def page_figures(reference: Path, candidate: Path) -> dict[str, dict]:
    """The heatmap page's two figures as plotly JSON, built as the page builds them (first divergence's step, all
    micro-batches, the rows it opens on)."""
    frame, step, rows = _page_view(reference, candidate)
    heatmap = step_view.step_view(frame, step, ALL_MICRO_BATCHES, rows, None).heatmap
    return {"heatmap": json.loads(heatmap.to_json()), "timeline": json.loads(step_view.step_timeline(frame, step).to_json())}


def plotly_render_seconds(specs: dict[str, dict]) -> dict[str, float]:
    """Seconds for plotly.js (the one bundled with plotly.py) to draw each figure in a bare chromium page:
    the browser's share of a page load, without Streamlit."""
    seconds = {}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1200})
            page.set_content("<div id=chart style='width:1500px'></div>")
            page.add_script_tag(content=plotly.offline.get_plotlyjs())
            for name, spec in specs.items():
                seconds[name] = page.evaluate("""async (spec) => { Plotly.purge('chart'); const started = performance.now();
                    await Plotly.newPlot('chart', spec.data, spec.layout, {displayModeBar: false});
                    return (performance.now() - started) / 1000; }""", spec)
        finally:
            browser.close()
    return seconds


def _goal(name: str, seconds: float, goal_s: float) -> Measure:
    return Measure(name=name, value=f"{seconds:.2f} s", goal=f"< {goal_s:g} s", met=seconds < goal_s)


def measures(workdir: Path, browser: dict, server: dict, heatmap_s: dict[str, float], index_s: dict[str, float],
             index_keys: dict[str, int], provenance: dict, repeats: int) -> list[Measure]:
    reference, candidate = workdir / "ref", workdir / "cand"
    heatmap_rows = server["heatmap_rows"]
    plotly_js = f"(plotly.py {plotly.__version__})"
    return [
        Measure(name="trace size ref / cand", value=f"{_trace_mib(reference):.0f} / {_trace_mib(candidate):.0f} MiB"),
        Measure(name="tensor keys ref / cand (RunReader index)", value=f"{index_keys['ref']} / {index_keys['cand']}"),
        Measure(name="open run index ref (RunReader)", value=f"{index_s['ref']:.2f} s"),
        Measure(name="open run index cand (RunReader)", value=f"{index_s['cand']:.2f} s"),
        Measure(name="comparison table rows / modules / heatmap rows as the page opens (layers) / heatmap markers",
                value=f"{server['num_rows']} / {heatmap_rows} / {server['shown_rows']} / {browser['num_markers']}"),
        _goal(f"first comparison (streamed), browser goto -> first divergence and the heatmap so far drawn (median of "
              f"{repeats})", statistics.median(browser["first_picture_s"]), FIRST_PICTURE_GOAL_S),
        _goal(f"first comparison, browser goto -> whole heatmap drawn (median of {repeats})", statistics.median(browser["first_s"]),
              WHOLE_HEATMAP_GOAL_S),
        _goal("  the first of them, in a browser that had loaded no page of the server yet: first divergence drawn",
              browser["first_picture_s"][0], FIRST_PICTURE_GOAL_S),
        _goal("  the first of them, in a browser that had loaded no page of the server yet: whole heatmap drawn",
              browser["first_s"][0], WHOLE_HEATMAP_GOAL_S),
        Measure(name="  of which compare_runs + table in the last job (its provenance seconds)", value=f"{provenance['seconds']:.1f} s"),
        Measure(name="  the job forked by the dashboard's warm worker (service/warm_worker.py), not a new Python",
                value="yes" if browser["job_warm"] and all(browser["job_warm"]) else "no"),
        _goal(f"cached heatmap, in the app: Runs -> 'Open the heatmap' -> drawn (median of {repeats})",
              statistics.median(browser["in_app_s"]), HEATMAP_GOAL_S),
        Measure(name=f"cached heatmap, cold page load: goto -> drawn (median of {repeats})",
                value=f"{statistics.median(browser['cached_s']):.2f} s"),
        Measure(name="  Streamlit's floor: cold load of a page showing one message",
                value=f"{statistics.median(browser['floor_s']):.2f} s"),
        Measure(name="  heatmap page server work in-process, a step's first visit (table + cells + heatmap figure; "
                     "later visits reuse it)", value=f"{heatmap_s['view_s']:.2f} s"),
        *[Measure(name=f"  plotly.js {plotly_js} draws the {name} figure alone (bare page)", value=f"{seconds:.2f} s")
          for name, seconds in server["render_s"].items()],
        Measure(name=f"timeline, drawn on request: section clicked -> drawn (median of {repeats})",
                value=f"{statistics.median(browser['timeline_s']):.2f} s"),
        Measure(name="  timeline built in-process, the first time it is opened", value=f"{heatmap_s['timeline_s']:.2f} s"),
        Measure(name="cell click -> drawn tensor page, browser wall time", value=f"{browser['click_s']:.2f} s"),
        _goal("tensor page server time: comparison_table (cached) + tensor_view (median of 5)", server["both_s"],
              TENSOR_SERVER_GOAL_S),
        Measure(name="  comparison_table (cached)", value=f"{server['table_s']:.3f} s"),
        Measure(name=f"  tensor_view ({browser['tensor']})", value=f"{server['view_s']:.3f} s"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ttrace-bench-dashboard"),
                        help="where the traces live; complete runs there are reused")
    parser.add_argument("--repeats", type=int, default=3, help="cached heatmap loads (median)")
    parser.add_argument("--num-layers", type=int, default=NUM_LAYERS, help="layers of the recorded GPT")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    recorded = record(workdir, args.num_layers)
    load = os.getloadavg()[0]
    reference, candidate = workdir / "ref", workdir / "cand"
    index_s = {name: _median_seconds(lambda: _open_index(workdir / name), 3) for name in RUNS}
    index_keys = {name: _open_index(workdir / name) for name in RUNS}
    port = free_port()
    server_process = start_dashboard(workdir, port, workdir / "dashboard.log")
    try:
        browser = browse(f"http://127.0.0.1:{port}", candidate, args.repeats)
    finally:
        stop_dashboard(server_process)
    cached = api.comparison_table(reference, candidate)
    server = tensor_server_seconds(reference, candidate, browser["tensor"], 5)
    server["heatmap_rows"] = len(cells.module_rows(cached.frame))
    frame, step, rows = _page_view(reference, candidate)
    server["shown_rows"] = len(step_view.step_view(frame, step, ALL_MICRO_BATCHES, rows, None).rows)
    heatmap_s = heatmap_server_seconds(reference, candidate, 3)
    server["render_s"] = plotly_render_seconds(page_figures(reference, candidate))
    rows = measures(workdir, browser, server, heatmap_s, index_s, index_keys, cached.provenance, args.repeats)
    _write(rows, recorded, (load, os.getloadavg()[0]), args.num_layers, args.results)


def _recording_note(recorded: dict[str, float | None]) -> str:
    parts = [f"{name} {'reused' if s is None else f'recorded in {s:.0f} s'}" for name, s in recorded.items()]
    return ", ".join(parts)


def _met(measure: Measure) -> str:
    return "-" if measure.met is None else ("yes" if measure.met else "**no**")


def _write(rows: list[Measure], recorded: dict[str, float | None], load: tuple[float, float], num_layers: int,
           results: Path) -> None:
    cpu = platform.processor() or platform.machine()
    lines = [
        f"# Dashboard latency ({num_layers}-layer Megatron GPT, hidden 64, 4 micro-batches, 1 step)", "",
        f"- date: {datetime.now().isoformat(timespec='seconds')}",
        f"- machine: {os.cpu_count()} cores ({cpu}), CPU only, Python {platform.python_version()}, chromium {CHROMIUM}; "
        f"1-min load average {load[0]:.2f} at the start, {load[1]:.2f} at the end (the server, chromium and other "
        "users' jobs share the cores)",
        "- runs: ref = tp 1; cand = tp 2 with --bug row-parallel-bias-per-rank (OMP_NUM_THREADS=1; "
        f"{_recording_note(recorded)})",
        "- browser times include page load, the Streamlit script run and plotly drawing; server times are in-process", "",
        "| measure | value | goal | met? |", "| --- | --- | --- | --- |",
    ]
    lines += [f"| {m.name} | {m.value} | {m.goal} | {_met(m)} |" for m in rows]
    text = "\n".join(lines) + "\n"
    results.mkdir(parents=True, exist_ok=True)
    (results / "dashboard.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
