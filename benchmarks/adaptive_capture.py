"""Adaptive capture against full capture on the megatron-core bug zoo: what each costs, and whether
both name the same first divergence.

For every zoo bug that runs on megatron-core, in the first layout that triggers it (fp32 unless the
layout says otherwise), it records the single-rank reference of that model variant, then the buggy
candidate twice: `ttrace example ... --out full` (values for every step) and `... --adaptive REF`
(statistics for every step, values for the window). Each is compared with the reference by
`ttrace compare`. Writes results/adaptive_capture.{md,json}.

    python benchmarks/adaptive_capture.py [--steps 3] [--work /var/tmp/ttrace-adaptive]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent
MODEL_FLAGS = ("--moe", "--swiglu", "--tie-embeddings")
SIZE = ["--num-layers", "2", "--hidden-size", "16"]


def ttrace(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ttrace_core", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return done, time.perf_counter() - started


def _model_flags(layout: list[str]) -> list[str]:
    """The flags of the layout that choose the model (and its precision), not its parallel layout."""
    kept, index = [], 0
    while index < len(layout):
        if layout[index] in MODEL_FLAGS:
            kept.append(layout[index])
        elif layout[index] == "--precision":
            kept += layout[index:index + 2]
            index += 1
        index += 1
    return kept


def _first_divergence(reference: Path, run: Path, out: Path) -> dict | None:
    done, _ = ttrace("compare", str(reference), str(run), "--json", str(out))
    if done.returncode not in (0, 1):
        raise RuntimeError(f"compare {run} failed: {done.stderr[-1500:]}")
    rows = json.loads(out.read_text())["comparisons"]
    first = next((row for row in rows if row["status"] != "pass"), None)
    return None if first is None else {"key": first["key"], "status": first["status"], "ratio": first["ratio"],
                                       "stats_only": first["stats_only"]}


def _size(run: Path) -> int:
    return sum(p.stat().st_size for p in run.glob("*.h5"))


def measure_bug(name: str, layout: list[str], work: Path, steps: int) -> dict:
    base = ["megatron-gpt", *SIZE, "--steps", str(steps)]
    model = _model_flags(layout)
    reference = work / ("reference" + "".join(model).replace("--", "-"))
    if not (reference / "manifest.json").is_file():
        shutil.rmtree(reference, ignore_errors=True)
        done, _ = ttrace("example", *base, *model, "--out", str(reference))
        if done.returncode:
            raise RuntimeError(f"reference {model} failed: {done.stderr[-1500:]}")
    runs = {}
    for mode in ("full", "adaptive"):
        out = work / f"{name}-{mode}"
        shutil.rmtree(out, ignore_errors=True)
        extra = ["--adaptive", str(reference)] if mode == "adaptive" else []
        done, seconds = ttrace("example", *base, *layout, "--bug", name, *extra, "--out", str(out))
        if done.returncode:
            raise RuntimeError(f"{name} {mode} failed: {done.stderr[-1500:]}")
        runs[mode] = {"seconds": seconds, "bytes": _size(out),
                      "first": _first_divergence(reference, out, work / f"{name}-{mode}.json")}
        if mode == "adaptive":
            runs[mode]["window"] = re.search(r"values for steps (\[[^\]]*\])", done.stdout).group(1)
            runs[mode]["passes"] = re.search(r"\); (.*)$", done.stdout.strip()).group(1)
    same = runs["full"]["first"] is not None and runs["adaptive"]["first"] is not None and \
        runs["full"]["first"]["key"] == runs["adaptive"]["first"]["key"]
    return {"bug": name, "layout": shlex.join(layout), **runs, "same_first_divergence": same}


def _key_text(first: dict | None) -> str:
    if first is None:
        return "none (pass)"
    key = first["key"]
    mb = "" if key["micro_batch"] < 0 else f" / mb {key['micro_batch']}"
    return f"step {key['step']}{mb} / {key['phase']} / {key['fqn']} / {key['slot']}"


def render(rows: list[dict], steps: int) -> str:
    mib = 2**20
    full_s = sum(r["full"]["seconds"] for r in rows)
    adaptive_s = sum(r["adaptive"]["seconds"] for r in rows)
    full_b = sum(r["full"]["bytes"] for r in rows)
    adaptive_b = sum(r["adaptive"]["bytes"] for r in rows)
    same = sum(r["same_first_divergence"] for r in rows)
    lines = [f"# Adaptive capture against full capture (megatron-core bug zoo, {steps} steps, 2 layers, hidden 16, 2 cores)",
             "", f"Same first divergence: **{same} of {len(rows)}** bugs. Trace bytes: adaptive "
             f"{adaptive_b / mib:.1f} MiB against full {full_b / mib:.1f} MiB ({adaptive_b / full_b:.2f}x). Wall time "
             f"(both include starting the ranks): adaptive {adaptive_s:.0f} s against full {full_s:.0f} s "
             f"({adaptive_s / full_s:.2f}x): adaptive runs the command twice.", "",
             "| bug | layout | first divergence (full capture) | same with adaptive? | window (steps with values) "
             "| full s | adaptive s (passes) | full MiB | adaptive MiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['bug']} | `{r['layout']}` | {_key_text(r['full']['first'])} | "
                     f"{'yes' if r['same_first_divergence'] else '**no**: ' + _key_text(r['adaptive']['first'])} | "
                     f"{r['adaptive']['window']} | {r['full']['seconds']:.1f} | {r['adaptive']['seconds']:.1f} "
                     f"({r['adaptive']['passes']}) | {r['full']['bytes'] / mib:.2f} | {r['adaptive']['bytes'] / mib:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from ttrace_examples.megatron_gpt.bugs import ZOO

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bugs", nargs="*", default=None, help="only these zoo bugs")
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/ttrace-adaptive"))
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for bug in ZOO.values():
        if bug.runs_on != "megatron-core" or (args.bugs and bug.name not in args.bugs):
            continue
        rows.append(measure_bug(bug.name, shlex.split(bug.triggers[0]), args.work, args.steps))
        print(f"{bug.name}: same first divergence: {rows[-1]['same_first_divergence']}", flush=True)
    text = render(rows, args.steps)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "adaptive_capture.md").write_text(text)
    (args.results / "adaptive_capture.json").write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
