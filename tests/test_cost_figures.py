"""docs/cost.md's figures are the results files' (benchmarks/results/): recording overhead and trace
bytes, compare throughput, index opening, the dashboard's first and cached heatmap, growth exponents."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _readme() -> str:
    return " ".join((ROOT / "docs" / "cost.md").read_text().split())


def _row(text: str, label: str, whole: bool = True) -> list[str]:
    """The table row whose first cell is `label` (or starts with it, when not `whole`)."""
    line = next(line for line in text.splitlines() if line.startswith(f"| {label} |" if whole else f"| {label}"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_recording_figures():
    rows = {r["mode"]: r for r in json.loads((RESULTS / "recording_overhead.json").read_text())["rows"]}
    readme = _readme()
    for mode in ("raw hooks", "stats-only", "full"):
        assert f"{rows[mode]['overhead']:.2f}x" in readme, mode
    assert f"**{rows['full']['bytes_ratio']:.2f}x** the bytes of the tensors they record" in readme


def test_second_machine_recording_figures():
    """The second machine's run (recording_overhead.py --name recording_overhead_second_machine): its ratios and
    the replayed statistics and Python that cost.md quotes."""
    results = json.loads((RESULTS / "recording_overhead_second_machine.json").read_text())
    rows = {r["mode"]: r for r in results["rows"]}
    readme = _readme()
    assert f"stats-only at **{rows['stats-only']['overhead']:.2f}x** and full at **{rows['full']['overhead']:.2f}x**" in readme
    text = (RESULTS / "recording_overhead_second_machine.md").read_text()
    replayed = _row(text, "**the record path replayed alone (no hooks, no timers; CPU time, least of 5)**")[2]
    stubbed = _row(text, "replayed with the statistics stubbed (the tracer's Python and the writes)")[2]
    statistics = float(replayed.strip("*")) - float(stubbed)
    assert f"the statistics take {statistics:.0f} us per tensor replayed" in readme
    assert f"against {float(stubbed):.0f} us of the tracer's Python" in readme
    limits = " ".join((ROOT / "docs" / "known-limits.md").read_text().split())
    assert f"the same code measured {rows['stats-only']['overhead']:.2f}x and {rows['full']['overhead']:.2f}x" in limits
    hooks = _row(text, "hooks alone (torch's hook machinery, no tracer): extra CPU time over untraced (paired), per tensor")[2]
    assert f"torch's hooks {float(hooks):.0f} us" in readme


def test_compare_and_index_figures():
    text = (RESULTS / "compare_throughput.md").read_text()
    in_process = _row(text, "after: `compare_runs` after imports (indexing included)")
    assert f"reads at {in_process[2]} MB/s, **{in_process[3]} of plain h5py**" in _readme()
    speedup = re.search(r"\*\*([0-9.]+)x faster\*\*", (RESULTS / "index_open.md").read_text()).group(1)
    assert f"**{speedup}x faster**" in _readme()


def test_dashboard_figures():
    text = (RESULTS / "dashboard.md").read_text()
    readme = _readme()
    first = _row(text, "first comparison (streamed), browser goto -> first divergence and the heatmap so far drawn",
                 whole=False)[1]
    whole = _row(text, "first comparison, browser goto -> whole heatmap drawn", whole=False)[1]
    cached = _row(text, "cached heatmap, in the app: Runs -> 'Open the heatmap' -> drawn (median of", whole=False)[1]
    timeline = _row(text, "timeline, drawn on request: section clicked -> drawn (median of", whole=False)[1]
    for seconds in (first, whole, cached, timeline):
        number = float(seconds.removesuffix(" s"))
        assert f"**{number:.1f} s**" in readme or f"**{number:.2f} s**" in readme, seconds


def test_growth_exponents():
    fits = json.loads((RESULTS / "scale.json").read_text())["fits"]
    readme = _readme()
    assert f"(fitted exponent {fits['compare_s']['tensors']:.2f})" in readme
    assert f"bytes ({fits['compare_s']['bytes']:.2f}:" in readme


def test_job_start_figures():
    """The warm worker's figures (benchmarks/job_start.py): the samples pair's medians, cold and warm."""
    point = json.loads((RESULTS / "job_start.json").read_text())["points"][0]
    cold, warm = point["median"]["cold"], point["median"]["warm"]
    readme = _readme()
    assert f"first rows **{warm['first_rows_s']:.2f} s** after the submit, against {cold['first_rows_s']:.2f} s" in readme
    assert f"whole table in {warm['table_s']:.2f} s against {cold['table_s']:.2f} s" in readme


def test_large_pair_figures():
    """The fitted cost per tensor and the slab-by-slab pair's peak RSS (benchmarks/large_pair.py)."""
    results = json.loads((RESULTS / "large_pair.json").read_text())
    readme = _readme()
    assert f"The fitted cost per tensor is **{results['fit']['per_tensor_us']:.1f} µs**" in readme
    slabbed = max((p for p in results["points"] if p["hidden"] == 4096), key=lambda p: p["bytes"])
    assert f"with a peak RSS of {slabbed['peak_rss_bytes'] / 2**20:.0f} MiB" in readme
    assert slabbed["peak_rss_bytes"] < results["max_bytes"]  # bounded by the budget, the interpreter included


def test_per_key_figures():
    """The same-run speed-ups of the per-key work and of the exact-inputs rule on the tiny pairs, under flat and
    derived tolerances, and the derived cost per key before and after (benchmarks/results/large_pair_per_key.json)."""
    points = sorted(json.loads((RESULTS / "large_pair_per_key.json").read_text())["points"], key=lambda p: p["layers"])
    cost = _readme()
    flat = " and ".join(f"**{p['before_s'] / p['seconds']:.2f}x**" for p in points)
    assert f"compares the tiny pairs {flat} faster" in cost
    derived = " and ".join(f"**{p['theorem_before_s'] / p['theorem_s']:.1f}x**" for p in points)
    assert f"{derived} faster on the same pairs" in cost
    before = [f"{p['theorem_before_s'] / p['keys'] * 1e6:,.0f} µs at {p['layers']} layers" for p in points]
    assert f"({before[0]}, {before[1]})" in cost
    after = " and ".join(f"{p['theorem_s'] / p['keys'] * 1e6:.0f}" for p in points)
    assert f"({after} µs per key, the same rows)" in cost
    assert all(p["theorem_s"] < p["theorem_before_s"] and p["seconds"] < p["before_s"] for p in points)


def test_known_limits_quote_the_results_files():
    """docs/known-limits.md's line on cost quotes the results files cost.md quotes: recording, the compare rate
    and the fitted cost per tensor."""
    limits = " ".join((ROOT / "docs" / "known-limits.md").read_text().split())
    rows = {r["mode"]: r for r in json.loads((RESULTS / "recording_overhead.json").read_text())["rows"]}
    assert f"recording costs {rows['stats-only']['overhead']:.2f}x (stats-only) and {rows['full']['overhead']:.2f}x " \
           "(full)" in limits
    in_process = _row((RESULTS / "compare_throughput.md").read_text(),
                      "after: `compare_runs` after imports (indexing included)")
    assert f"Compare reads at {in_process[3]} of plain h5py's rate in-process" in limits
    per_tensor = json.loads((RESULTS / "large_pair.json").read_text())["fit"]["per_tensor_us"]
    assert f"a fitted cost of {per_tensor:.1f} µs per tensor" in limits
