"""How ttrace's costs grow with the model: record, compare and first heatmap at 4 sizes.

For each size (megatron-gpt layers x hidden, spanning more than 30x in trace bytes) it records a
single-rank reference and a TP 2 candidate (`ttrace example megatron-gpt`, one step), then in this
process times the comparison (`api.comparison_table(..., rebuild=True)`) and the heatmap page's own
work on the table (cells and both figures, serialized). It fits each cost against the trace bytes and
the tensor count on log-log axes: a slope of 1 is linear growth. Writes results/scale.{md,json} and
results/scale.png (plotly, drawn by Debian's chromium: no extra plotting package).

    python benchmarks/scale.py [--work /tmp/ttrace-bench-scale]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import plotly.offline
from playwright.sync_api import sync_playwright

from ttrace_core import api
from ttrace_core.format.reader import RunReader
from ttrace_dashboard import cells, figures

RESULTS = Path(__file__).parent / "results"
SIZES = [(4, 64), (12, 128), (24, 192), (48, 256)]
"""(layers, hidden) of each model: the trace bytes span about 50x."""
RUNS = {"ref": [], "cand": ["--tp", "2"]}
CHROMIUM = "/usr/bin/chromium"
COSTS = ("record_s", "compare_s", "heatmap_s")


def record(run_dir: Path, layers: int, hidden: int, flags: list[str]) -> float:
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", "ttrace_core", "example", "megatron-gpt", "--num-layers", str(layers),
               "--hidden-size", str(hidden), "--steps", "1", *flags, "--out", str(run_dir)]
    started = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def heatmap_seconds(reference: Path, candidate: Path) -> float:
    """The heatmap page's work on the table: first divergence, cells, both figures as JSON."""
    frame = api.comparison_table(reference, candidate).frame
    started = time.perf_counter()
    first = cells.first_divergence(frame)
    step = int(first["step"]) if first is not None else int(frame["step"].min())
    shown = cells.rows_by_layer(frame) if frame["module"].nunique() > 200 else frame
    figures.heatmap_figure(cells.heatmap_cells(shown, step, "all"), cells.module_rows(shown)).to_json()
    figures.timeline_figure(cells.timeline_points(frame, step), None).to_json()
    return time.perf_counter() - started


def measure(work: Path, layers: int, hidden: int) -> dict:
    size = work / f"L{layers}-H{hidden}"
    record_s = sum(record(size / name, layers, hidden, flags) for name, flags in RUNS.items())
    reference, candidate = size / "ref", size / "cand"
    started = time.perf_counter()
    api.comparison_table(reference, candidate, rebuild=True)
    compare_s = time.perf_counter() - started
    with RunReader(reference) as ref, RunReader(candidate) as cand:
        num_tensors = len(ref.index) + len(cand.index)
    trace_bytes = sum(p.stat().st_size for run in (reference, candidate) for p in run.glob("*.h5"))
    return {"layers": layers, "hidden": hidden, "trace_bytes": trace_bytes, "num_tensors": num_tensors,
            "record_s": record_s, "compare_s": compare_s, "heatmap_s": heatmap_seconds(reference, candidate)}


def slope(xs: list[float], ys: list[float]) -> float:
    """The exponent of y ~ x^k, least squares on log-log axes."""
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def save_png(figure: go.Figure, out: Path) -> None:
    """The figure as a PNG at `out`, drawn by plotly.js in Debian's chromium (no downloaded browser, no kaleido)."""
    page = out.with_suffix(".html")
    page.write_text(plotly.offline.plot(figure, include_plotlyjs=True, output_type="div", config={"staticPlot": True}))
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            tab = browser.new_page(viewport={"width": 940, "height": 600})
            tab.goto(page.resolve().as_uri())
            tab.wait_for_selector(".js-plotly-plot .main-svg")
            tab.locator(".js-plotly-plot").first.screenshot(path=str(out))
        finally:
            browser.close()
    page.unlink()


def plot(points: list[dict], out: Path) -> None:
    figure = go.Figure()
    mib = [p["trace_bytes"] / 2**20 for p in points]
    for cost in COSTS:
        figure.add_trace(go.Scatter(x=mib, y=[p[cost] for p in points], mode="lines+markers", name=cost.removesuffix("_s")))
    figure.update_layout(title="ttrace cost against trace size (megatron-gpt, ref + TP2 candidate, 2 CPU cores)",
                         xaxis=dict(title="trace MiB (both runs)", type="log"), yaxis=dict(title="seconds", type="log"),
                         width=900, height=560, template="plotly_white")
    save_png(figure, out)


def render(points: list[dict], fits: dict) -> str:
    span = points[-1]["trace_bytes"] / points[0]["trace_bytes"]
    lines = [
        "# How the costs grow with the model",
        "",
        "`python benchmarks/scale.py`: megatron-gpt (4 micro-batches of 2 x 16 tokens, one step) at 4 sizes, a "
        "single-rank reference and a TP 2 candidate each; `record` is both runs' `ttrace example` wall time "
        "(starting Python, torch and the ranks included), `compare` the comparison table computed in this process "
        "(`rebuild=True`), `heatmap` the heatmap page's work on that table (cells, both figures as JSON). "
        f"2 CPU cores shared with other jobs. Trace bytes span {span:.0f}x.",
        "",
        "![cost against trace size](scale.png)",
        "",
        "| layers x hidden | trace MiB | tensors | record (s) | compare (s) | heatmap (s) | compare MB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {p['layers']} x {p['hidden']} | {p['trace_bytes'] / 2**20:.0f} | {p['num_tensors']} | {p['record_s']:.1f} | "
              f"{p['compare_s']:.1f} | {p['heatmap_s']:.2f} | {p['trace_bytes'] / 1e6 / p['compare_s']:.0f} |" for p in points]
    lines += ["", "Fitted growth (exponent k of cost ~ size^k, least squares on log-log axes; 1 is linear):", "",
              "| cost | against trace bytes | against tensor count |", "|---|---|---|"]
    lines += [f"| {cost.removesuffix('_s')} | {fits[cost]['bytes']:.2f} | {fits[cost]['tensors']:.2f} |" for cost in COSTS]
    lines += ["", "A cost that starts Python and torch (record) has a fixed part, so its exponent sits below 1 "
              "at small sizes; an exponent above 1 would mean work that grows faster than the trace."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/ttrace-bench-scale"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    points = []
    for layers, hidden in SIZES:
        points.append(measure(args.work, layers, hidden))
        print(json.dumps(points[-1]), flush=True)
    fits = {cost: {"bytes": slope([p["trace_bytes"] for p in points], [p[cost] for p in points]),
                   "tensors": slope([p["num_tensors"] for p in points], [p[cost] for p in points])} for cost in COSTS}
    RESULTS.mkdir(exist_ok=True)
    plot(points, RESULTS / "scale.png")
    (RESULTS / "scale.json").write_text(json.dumps({"points": points, "fits": fits}, indent=1))
    text = render(points, fits)
    (RESULTS / "scale.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
