"""`ttrace check` on the whole megatron-gpt matrix: time per layout, total time, bytes, reuse on a second run.

Runs `ttrace check` twice on ttrace_examples/configs/megatron-gpt.toml (every layout, every precision
it lists) with one more layout carrying a zoo bug (so the gate has a failure to localize and report),
in a work directory of its own. The second run changes nothing, so it should reuse every recording,
comparison and replay. Writes results/check.md (and check.json): per layout and precision the
seconds to record, compare and localize, the trace's bytes and whether the second run reused it; the
Markdown summary the first run printed.

    python benchmarks/check.py [--work /tmp/ttrace-bench-check] [--jobs 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = ROOT / "ttrace_examples" / "configs" / "megatron-gpt.toml"
BUG_LAYOUT = {"name": "tp2-bug", "layout": "tp=2 bug=row-parallel-bias-per-rank", "world_size": 2}


def _toml_value(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)


def write_config(work: Path) -> Path:
    """The shipped config, its paths pointed at this checkout and `work`, plus the bug layout."""
    data = tomllib.loads(CONFIG.read_text())
    data.update(cwd=str(ROOT), output=str(work / "out"))
    lines = [f"{key} = {_toml_value(value)}" for key, value in data.items() if key not in ("reference", "candidate")]
    lines += ["", "[reference]", *(f"{k} = {_toml_value(v)}" for k, v in data["reference"].items())]
    for candidate in [*data["candidate"], BUG_LAYOUT]:
        lines += ["", "[[candidate]]", *(f"{k} = {_toml_value(v)}" for k, v in candidate.items())]
    path = work / "megatron-gpt.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_check(config: Path, jobs: int, log: Path) -> tuple[float, int, dict]:
    started = time.perf_counter()
    with open(log, "w") as output:
        done = subprocess.run([sys.executable, "-m", "ttrace_core", "check", str(config), "--jobs", str(jobs)],
                              stdout=output, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              cwd=config.parent)
    seconds = time.perf_counter() - started
    return seconds, done.returncode, json.loads((config.parent / "out" / "check.json").read_text())


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*.h5")) if path else 0


def render(first: tuple, second: tuple, summary: str, jobs: int) -> str:
    (first_s, first_code, first_json), (second_s, second_code, second_json) = first, second
    reused = {(r["precision"], r["name"]): r["reused"] for r in second_json["layouts"]}
    lines = [
        "# `ttrace check`: the megatron-gpt matrix",
        "",
        f"`python benchmarks/check.py --jobs {jobs}`: `ttrace check` on ttrace_examples/configs/megatron-gpt.toml "
        f"(megatron-core GPT, 4 layers, hidden 64; precisions {', '.join(first_json['references'])}) with one more "
        f"layout carrying the zoo bug `{BUG_LAYOUT['layout']}`, run twice on 2 CPU cores shared with other jobs. "
        "Seconds are wall time of that run (they vary 2x between runs on these machines).",
        "",
        f"- first run: {first_s:.0f} s in all, exit code {first_code}",
        f"- second run, nothing changed: {second_s:.0f} s, exit code {second_code}; "
        f"{sum(reused.values())} of {len(reused)} candidate recordings and "
        f"{sum(r['reused'] for r in second_json['references'].values())} of {len(second_json['references'])} references reused",
        "",
        "| precision | layout | verdict | record (s) | compare (s) | localize (s) | trace MiB | reused on the 2nd run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for precision, reference in first_json["references"].items():
        lines.append(f"| {precision} | reference (+ estimate) | - | {reference['record_s'] + reference['estimate_s']:.1f} | - | - | "
                     f"{_bytes(reference['run_dir']) / 2**20:.1f} | {second_json['references'][precision]['reused']} |")
    for found in first_json["layouts"]:
        seconds = found["seconds"]
        lines.append(f"| {found['precision']} | {found['name']} (`{found['layout']}`) | {found['outcome']} | "
                     f"{seconds.get('record', 0):.1f} | {seconds.get('compare', 0):.1f} | "
                     f"{_seconds(seconds.get('localize'))} | "
                     f"{_bytes(found['run_dir']) / 2**20:.1f} | {reused[found['precision'], found['name']]} |")
    lines += ["", "## The Markdown summary of the first run", "", summary]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/ttrace-bench-check"))
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    config = write_config(args.work)
    first = run_check(config, args.jobs, args.work / "first.log")
    summary = (args.work / "out" / "summary.md").read_text()
    second = run_check(config, args.jobs, args.work / "second.log")
    text = render(first, second, summary.replace(str(args.work), "WORK"), args.jobs)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "check.md").write_text(text)
    (RESULTS / "check.json").write_text(json.dumps({"first_s": first[0], "second_s": second[0], "first_exit": first[1],
                                                    "second_exit": second[1], "first": first[2], "second": second[2]},
                                                   indent=1).replace(str(args.work), "WORK"))
    print(text)


if __name__ == "__main__":
    main()
