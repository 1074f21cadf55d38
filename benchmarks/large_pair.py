"""Comparing a large pair in bounded memory: cost per byte and per tensor, at 10 GB and more.

Two shapes of model, each a 1-rank reference and a TP 2 candidate (megatron-style layouts: column
parallel outputs and weights S(-1)/S(0), row parallel weights S(1), layer norms and reduced outputs
replicated on both ranks), one step:

- many layers of a small hidden size (256): many tensors of a quarter megabyte (4 micro-batches);
- few layers of a large hidden size (4096): few tensors of 32 to 256 MiB, compared slab by slab;
- tiny tensors (hidden 8), not large at all: the per-tensor cost alone, which pins the fit's constant.

The traces are synthetic: every tensor is a view of one random buffer, the candidate's shards the
matching slices of the reference's tensors times 1 + 2**-20, written through ttrace's own RunWriter (trace format 5),
so recording a model of this size is not needed. Each shape is built at a quarter of its size and
whole (at least 10 GB of tensor bytes for the pair), the pair is compared in a child process under
`--max-memory` (`compare_runs(..., max_bytes=...)`, after its imports: Python's start is not in the
figure) with its peak RSS, and plain h5py reads every dataset of the same pair in the same run. The
points compared whole fit compare's seconds = per byte x bytes + per tensor x tensors + fixed, least
squares.
Writes results/large_pair.{md,json,png}; deletes each pair when it is measured. With `--before CHECKOUT`
(a git worktree of an earlier commit), each pair is also compared by that code, alternating with this one, and
only a before/after table is written (results/NAME.{md,json}): a speed-up measured in one run.

    python benchmarks/large_pair.py [--work /var/tmp/ttrace-large-pair] [--max-memory 1GiB] [--scale 1.0]
    python benchmarks/large_pair.py --before /var/tmp/old --shape "few layers, hidden 4096" --name large_pair_before_after
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch

from ttrace_core.format.schema import Layout, RunManifest, TensorKey, TensorMeta
from ttrace_core.format.writer import RunWriter, stats_from_tensor, write_manifest

RESULTS = Path(__file__).parent / "results"
TP = 2
CANDIDATE_FACTOR = 1.0 + 2.0**-20
"""The candidate's values are the reference's times this: a relative difference of 1e-6, within fp32's tolerance,
so every element's difference is read off as in a real comparison (equal values would skip the mismatch count)."""
GIB = 2**30


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    tokens: int
    """Rows of an activation ([tokens, hidden]: sequence x batch, flattened)."""
    micro_batches: int
    full_layers: int
    """Layers of the whole pair (at least 10 GB of tensor bytes)."""


SHAPES = [Shape("many layers, hidden 256", hidden=256, tokens=256, micro_batches=4, full_layers=142),
          Shape("few layers, hidden 4096", hidden=4096, tokens=2048, micro_batches=1, full_layers=3),
          Shape("tiny tensors, hidden 8", hidden=8, tokens=8, micro_batches=4, full_layers=400)]
"""The third shape is not large: its tensors of 256 bytes to 1 KiB make compare's cost almost all per tensor,
which pins the per-tensor constant of the fit."""
SLABS = "few layers, hidden 4096"
"""The shape whose tensors exceed the budget and are compared slab by slab (bounded.py): its cost per byte is
that of slabs, so it is reported on its own and left out of the fit."""

# (module, slot, width in hidden units, placement on the TP axis): forward outputs and the gradients
# flowing back into them; a column-parallel output is sharded on its last dim, a reduced one replicated.
ACTIVATIONS = [("input_layernorm", 1, "R"), ("self_attention.linear_qkv", 3, "S(-1)"),
               ("self_attention.core_attention", 1, "S(-1)"), ("self_attention.linear_proj", 1, "R"),
               ("pre_mlp_layernorm", 1, "R"), ("mlp.linear_fc1", 4, "S(-1)"), ("mlp.linear_fc2", 1, "R")]
# (parameter, shape in hidden units, placement): a row-parallel weight is sharded on its input dim.
PARAMETERS = [("input_layernorm.weight", (1,), "R"), ("self_attention.linear_qkv.weight", (3, 1), "S(0)"),
              ("self_attention.linear_proj.weight", (1, 1), "S(1)"), ("pre_mlp_layernorm.weight", (1,), "R"),
              ("mlp.linear_fc1.weight", (4, 1), "S(0)"), ("mlp.linear_fc2.weight", (1, 4), "S(1)")]


class Values:
    """Tensors as views of one random buffer, at offsets that move on: no generation cost per byte."""

    def __init__(self, numel: int) -> None:
        self.pool = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        self.offset = 0

    def next(self, shape: tuple[int, ...]) -> torch.Tensor:
        numel = math.prod(shape)
        if self.offset + numel > self.pool.numel():
            self.offset = 0
        value = self.pool[self.offset:self.offset + numel].view(shape)
        self.offset = (self.offset + numel // 2 + 97) % (self.pool.numel() // 2)
        return value


def _tensors(shape: Shape, layers: int):
    """(key, full value's shape, placement) of every tensor of the step, in execution order."""
    h, t = shape.hidden, shape.tokens
    for micro_batch in range(shape.micro_batches):
        for phase, slot in (("forward", "output.0"), ("backward", "grad_input.0")):
            order = range(layers) if phase == "forward" else reversed(range(layers))
            for layer in order:
                for module, width, placement in (ACTIVATIONS if phase == "forward" else ACTIVATIONS[::-1]):
                    key = TensorKey(step=0, micro_batch=micro_batch, phase=phase, fqn=f"decoder.layers.{layer}.{module}",
                                    slot=slot)
                    yield key, (t, width * h), placement
    for phase, slot in (("grad", "grad"), ("param", "value")):
        for layer in range(layers):
            for name, dims, placement in PARAMETERS:
                key = TensorKey(step=0, micro_batch=-1, phase=phase, fqn=f"decoder.layers.{layer}.{name}", slot=slot)
                yield key, tuple(d * h for d in dims), placement


def _shard(value: torch.Tensor, placement: str, coordinate: int) -> torch.Tensor:
    if placement == "R":
        return value
    dim = int(placement[2:-1]) % value.dim()
    return value.chunk(TP, dim)[coordinate]


def _meta(key: TensorKey, rank: int, value: torch.Tensor, global_shape: tuple[int, ...], placements: tuple[str, ...],
          mesh: tuple[int, ...], seq: int) -> TensorMeta:
    layout = Layout(global_shape=global_shape, mesh_shape=mesh, coordinate=(rank,) if mesh else (), placements=placements,
                    mesh_axis_names=("tp",) if mesh else ())
    return TensorMeta(key=key, rank=rank, dtype="float32", local_shape=tuple(value.shape), layout=layout, seq=seq,
                      stats=stats_from_tensor(value))


def write_pair(work: Path, shape: Shape, layers: int, values: Values) -> tuple[Path, Path, float]:
    """The reference and the TP 2 candidate of `layers` layers; (reference, candidate, seconds writing)."""
    reference, candidate = work / "reference", work / "candidate"
    model = {"hidden_size": shape.hidden, "num_layers": layers, "tokens": shape.tokens}
    write_manifest(reference, RunManifest(role="reference", world_size=1, degrees={"tp": 1}, model=model))
    write_manifest(candidate, RunManifest(role="candidate", world_size=TP, degrees={"tp": TP}, mesh_shape=[TP],
                                          mesh_axis_names=["tp"], rank_coordinates=[[r] for r in range(TP)], model=model))
    writers = [RunWriter(reference, 0)] + [RunWriter(candidate, rank) for rank in range(TP)]
    seconds = 0.0
    for writer in writers:
        writer.begin_step(0)
    for seq, (key, global_shape, placement) in enumerate(_tensors(shape, layers)):
        value = values.next(global_shape)
        metas = [(writers[0], _meta(key, 0, value, global_shape, (), (), seq), value)]
        for rank in range(TP):
            local = _shard(value, placement, rank) * CANDIDATE_FACTOR  # a copy, as round-off would leave it
            metas.append((writers[1 + rank], _meta(key, rank, local, global_shape, (placement,), (TP,), seq), local))
        started = time.perf_counter()
        for writer, meta, local in metas:
            writer.write(meta, local)
        seconds += time.perf_counter() - started
    started = time.perf_counter()
    for writer in writers:
        writer.end_step()
    return reference, candidate, seconds + time.perf_counter() - started


def tensor_bytes(run: Path) -> int:
    """Bytes of every tensor with values, duplicates once (the packs' sizes)."""
    total = 0
    for path in run.glob("rank_*.h5"):
        with h5py.File(path, "r") as handle:
            total += sum(dataset.shape[0] for dataset in handle["packs"].values())
    return total


def plain_read_seconds(runs: tuple[Path, Path]) -> float:
    """h5py reading every pack of both runs once, a chunk of 64 MiB at a time (bounded memory too)."""
    buffer = np.empty(64 * 2**20, dtype=np.uint8)
    started = time.perf_counter()
    for run in runs:
        for path in sorted(run.glob("rank_*.h5")):
            with h5py.File(path, "r") as handle:
                for dataset in handle["packs"].values():
                    for start in range(0, dataset.shape[0], buffer.size):
                        stop = min(dataset.shape[0], start + buffer.size)
                        dataset.read_direct(buffer, np.s_[start:stop], np.s_[:stop - start])
    return time.perf_counter() - started


IN_CHILD = """import json, sys, time
from ttrace_core.compare.engine import compare_runs
from ttrace_core.compare.step_scalars import with_step_scalars
from ttrace_core.compare.tolerances import select_tolerances
from ttrace_core.format.reader import RunReader
def peak_rss_bytes():
    line = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
started = time.perf_counter()
with RunReader(sys.argv[1]) as reference, RunReader(sys.argv[2]) as candidate:
    opened = time.perf_counter()
    kind = sys.argv[4]
    tolerances = None if kind == "auto" else with_step_scalars(select_tolerances(kind, reference, candidate), reference, candidate)
    result = compare_runs(reference, candidate, tolerances, max_bytes=int(sys.argv[3]))
    keys = len(reference.index) + len(candidate.index)
    shards = sum(len(m) for r in (reference, candidate) for m in r.index.values())
done = time.perf_counter()
print(json.dumps({"open_s": opened - started, "compare_s": done - opened, "keys": keys, "shards": shards,
                  "rows": len(result.comparisons), "passed": sum(bool(c) for c in result.comparisons),
                  "peak_rss_bytes": peak_rss_bytes()}))
"""
# ru_maxrss survives fork and exec (Linux): a child would report the benchmark's own peak when it is larger, so the
# child's peak is its memory map's high-water mark, which a new program starts afresh.


DERIVED = "tiny tensors, hidden 8"
"""The shape also compared under derived tolerances (`--tolerance theorem`, which needs no estimate): those turn on
the exact-inputs rule (compare/exact_inputs.py), whose questions must cost each module's subtree, not the run."""


def compare_in_child(reference: Path, candidate: Path, max_bytes: int, code: Path | None = None,
                     tolerance: str = "auto") -> dict:
    """`code`: a checkout of ttrace to compare with instead of the installed one (`--before`); `tolerance`: as
    `ttrace compare --tolerance` ("auto": the dtype table here, the synthetic reference holding no estimate)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"PYTHONPATH": str(code)} if code else {})}
    done = subprocess.run([sys.executable, "-c", IN_CHILD, str(reference), str(candidate), str(max_bytes), tolerance],
                          capture_output=True, text=True, check=True, env=env, cwd=code or None)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(work: Path, shape: Shape, layers: int, max_bytes: int, before: Path | None = None) -> dict:
    """`before`: also compare the pair with the code of that checkout, alternating with this code's runs."""
    shutil.rmtree(work, ignore_errors=True)
    values = Values(72 * 2**20)  # the largest tensor (a 4h x h weight of hidden 4096) is 64Mi elements
    reference, candidate, write_s = write_pair(work, shape, layers, values)
    del values
    num_bytes = tensor_bytes(reference) + tensor_bytes(candidate)
    plain_before = plain_read_seconds((reference, candidate))
    runs: dict[Path | None, list[dict]] = {None: [], **({before: []} if before else {})}
    # the least disturbed of two each; of five for the tiny shape, which compares in seconds and whose per-tensor
    # cost a shared machine's noise (timings of the same code here vary by a third) hides in two
    for _ in range(5 if shape.name == DERIVED else 2):
        for code, found in runs.items():
            found.append(compare_in_child(reference, candidate, max_bytes, code))
    child, *earlier = (min(found, key=lambda f: f["open_s"] + f["compare_s"]) for found in runs.values())
    if earlier:
        child["before_s"] = earlier[0]["open_s"] + earlier[0]["compare_s"]
        assert (earlier[0]["rows"], earlier[0]["passed"]) == (child["rows"], child["passed"]), (earlier[0], child)
    if shape.name == DERIVED:
        derived: dict[Path | None, list[dict]] = {None: [], **({before: []} if before else {})}
        for _ in range(2):
            for code, found in derived.items():
                found.append(compare_in_child(reference, candidate, max_bytes, code, tolerance="theorem"))
        mine, *theirs = (min(found, key=lambda f: f["open_s"] + f["compare_s"]) for found in derived.values())
        child["theorem_s"], child["theorem_passed"] = mine["open_s"] + mine["compare_s"], mine["passed"]
        if theirs:
            child["theorem_before_s"] = theirs[0]["open_s"] + theirs[0]["compare_s"]
            assert theirs[0]["passed"] == mine["passed"], (theirs[0], mine)
    plain_after = plain_read_seconds((reference, candidate))
    shutil.rmtree(work, ignore_errors=True)
    seconds = child["open_s"] + child["compare_s"]
    point = {"shape": shape.name, "hidden": shape.hidden, "layers": layers, "bytes": num_bytes, "write_s": write_s,
             "plain_s": [plain_before, plain_after], **child, "seconds": seconds,
             "mb_per_s": num_bytes / 1e6 / seconds, "tensors_per_s": child["keys"] / seconds,
             "plain_share": min(plain_before, plain_after) / seconds}
    print(json.dumps(point), flush=True)
    return point


def fit(points: list[dict]) -> dict:
    """seconds = per_byte * bytes + per_tensor * tensors + fixed, least squares over the points compared whole."""
    points = [p for p in points if p["shape"] != SLABS]
    matrix = np.array([[p["bytes"], p["keys"], 1.0] for p in points])
    seconds = np.array([p["seconds"] for p in points])
    (per_byte, per_tensor, fixed), *_ = np.linalg.lstsq(matrix, seconds, rcond=None)
    predicted = matrix @ np.array([per_byte, per_tensor, fixed])
    return {"per_byte_s": float(per_byte), "per_tensor_us": float(per_tensor) * 1e6, "fixed_s": float(fixed),
            "mb_per_s_marginal": 1e-6 / float(per_byte) if per_byte > 0 else math.inf,
            "worst_residual": float(np.max(np.abs(predicted - seconds) / seconds))}


def plot(points: list[dict], out: Path) -> None:
    import plotly.graph_objects as go

    from scale import save_png  # benchmarks/scale.py, beside this script

    figure = go.Figure()
    for name in dict.fromkeys(p["shape"] for p in points):
        mine = [p for p in points if p["shape"] == name]
        figure.add_trace(go.Scatter(x=[p["bytes"] / GIB for p in mine], y=[p["seconds"] for p in mine],
                                    mode="lines+markers", name=f"compare, {name}"))
        figure.add_trace(go.Scatter(x=[p["bytes"] / GIB for p in mine], y=[min(p["plain_s"]) for p in mine],
                                    mode="lines+markers", name=f"plain h5py read, {name}", line={"dash": "dot"}))
    figure.update_layout(title="compare of a large pair against its bytes (TP 2 candidate vs 1-rank reference, bounded memory)",
                         xaxis=dict(title="tensor GiB (both runs)", type="log"), yaxis=dict(title="seconds", type="log"),
                         width=900, height=560, template="plotly_white")
    save_png(figure, out)


def _commit(checkout: Path) -> str:
    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def render_before_after(points: list[dict], before: Path, max_bytes: int, load: str, name: str) -> str:
    shapes = " ".join(f'--shape "{shape}"' for shape in dict.fromkeys(p["shape"] for p in points))
    lines = ["# Comparing a large pair: the code before and after, in the same run", "",
             f"`python benchmarks/large_pair.py --before CHECKOUT {shapes} --name {name}`, the "
             f"checkout at {_commit(before)} (before), this code at {_commit(Path(__file__).parent)} (after, uncommitted "
             "changes included): the pairs of large_pair.md, each compared twice by each code (five times the tiny shape; "
             "twice under derived tolerances), alternating, the fastest of each kept; "
             f"`compare_runs(..., max_bytes={max_bytes // 2**20} MiB)` in a child "
             f"process after its imports. 2 shared CPU cores; {load}.", "",
             "| shape | layers | tensor GB | before (s) | after (s) | speed-up | after, MB/s | plain h5py (s) | "
             "after, share of plain | rows passed (both) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['shape']} | {p['layers']} | {p['bytes'] / 1e9:.2f} | {p['before_s']:.1f} | {p['seconds']:.1f} | "
                     f"{p['before_s'] / p['seconds']:.2f}x | {p['mb_per_s']:.0f} | {min(p['plain_s']):.1f} | "
                     f"{p['plain_share']:.0%} | {p['passed']}/{p['rows']} |")
    derived = [p for p in points if "theorem_before_s" in p]
    if derived:
        lines += ["", "Under derived tolerances (`--tolerance theorem`: the exact-inputs rule on), the same way:", "",
                  "| shape | layers | before (s) | after (s) | speed-up | before, µs per key | after, µs per key | rows passed (both) |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {p['shape']} | {p['layers']} | {p['theorem_before_s']:.1f} | {p['theorem_s']:.1f} | "
                  f"{p['theorem_before_s'] / p['theorem_s']:.1f}x | {p['theorem_before_s'] / p['keys'] * 1e6:.0f} | "
                  f"{p['theorem_s'] / p['keys'] * 1e6:.0f} | {p['theorem_passed']}/{p['rows']} |" for p in derived]
    return "\n".join(lines + [""])


def render(points: list[dict], fitted: dict, max_bytes: int, load: str) -> str:
    lines = ["# Comparing a large pair in bounded memory", "",
             "`python benchmarks/large_pair.py`: synthetic traces written through ttrace's own RunWriter (trace format "
             "5; every tensor a view of one random buffer, the candidate's shards slices of the reference's tensors times "
             "1 + 2**-20), "
             f"a 1-rank reference against a TP {TP} candidate, one step, each shape at a quarter of its size and whole; "
             "each pair compared twice (the tiny shape five times), the fastest kept. "
             f"Compared in a child process after its imports with `compare_runs(..., max_bytes={max_bytes // 2**20} MiB)` "
             "(`ttrace compare --max-memory`), plain h5py reading every pack of the same pair before and after it. "
             f"2 shared CPU cores; {load}.", "",
             "![compare against bytes](large_pair.png)", "",
             "| shape | layers | tensor GB | tensors (keys) | shards | compare (s) | MB/s | tensors/s | plain h5py (s) | "
             "share of plain | peak RSS (MiB) | rows passed |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['shape']} | {p['layers']} | {p['bytes'] / 1e9:.2f} | {p['keys']} | {p['shards']} | "
                     f"{p['seconds']:.1f} | {p['mb_per_s']:.0f} | {p['tensors_per_s']:.0f} | {min(p['plain_s']):.1f} | "
                     f"{p['plain_share']:.0%} | {p['peak_rss_bytes'] / 2**20:.0f} | {p['passed']}/{p['rows']} |")
    lines += ["", f"Fitted over the points compared whole (the slab-by-slab shape left out: its cost per byte is that of "
              f"slabs): compare's seconds = bytes / ({fitted['mb_per_s_marginal']:.0f} MB/s) + "
              f"**{fitted['per_tensor_us']:.1f} µs per tensor** + {fitted['fixed_s']:.2f} s (worst residual "
              f"{fitted['worst_residual']:.0%}). Tensors are logical tensors of both runs (keys), as in scale.md.", ""]
    derived = [p for p in points if "theorem_s" in p]
    if derived:
        lines += ["**Under derived tolerances** (`--tolerance theorem`: the exact-inputs rule on, every key a question "
                  "about its module's sources; the synthetic perturbation of 2**-20 fails most rows there, whose words "
                  "cost more than a pass): " + ", ".join(
                      f"{p['layers']} layers {p['theorem_s']:.1f} s, **{p['theorem_s'] / p['keys'] * 1e6:.1f} µs per key** "
                      f"({p['theorem_passed']}/{p['rows']} rows passed)" for p in derived) + ".", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/ttrace-large-pair"))
    parser.add_argument("--max-memory", type=int, default=GIB, help="compare's memory budget in bytes")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every size (a smoke run: 0.05)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--before", type=Path, help="a checkout of ttrace (git worktree): compare each pair with its "
                                                    "code too, alternating, and write a before/after table only")
    parser.add_argument("--shape", action="append", choices=[shape.name for shape in SHAPES],
                        help="only this shape (repeat for more; default: all)")
    parser.add_argument("--name", default="large_pair", help="the results files' name")
    args = parser.parse_args()
    load = f"load average {os.getloadavg()[0]:.1f} at the start"
    points = []
    for shape in SHAPES:
        for fraction in (0.25, 1.0) if not args.shape or shape.name in args.shape else ():
            layers = max(1, round(shape.full_layers * fraction * args.scale))
            points.append(measure(args.work, shape, layers, args.max_memory, args.before))
    if args.before:
        load += f", {os.getloadavg()[0]:.1f} at the end"
        (args.results / f"{args.name}.json").write_text(json.dumps({"points": points, "before": str(args.before),
                                                                    "max_bytes": args.max_memory, "load": load}, indent=1))
        text = render_before_after(points, args.before, args.max_memory, load, args.name)
        (args.results / f"{args.name}.md").write_text(text)
        print(text)
        return
    fitted = fit(points)
    load += f", {os.getloadavg()[0]:.1f} at the end"
    args.results.mkdir(parents=True, exist_ok=True)
    plot(points, args.results / f"{args.name}.png")
    (args.results / f"{args.name}.json").write_text(json.dumps({"points": points, "fit": fitted, "max_bytes": args.max_memory,
                                                             "load": load}, indent=1))
    text = render(points, fitted, args.max_memory, load)
    (args.results / f"{args.name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
