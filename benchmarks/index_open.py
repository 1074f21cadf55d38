"""Opening a large run: the tensor index (format 5's packs, format 4's dataset per tensor) against format 3's
attribute per dataset, in one run.

Writes one rank of a 48-layer-sized step through RunWriter (15,838 tensors, as a 48-layer Megatron
GPT run records: every module's inputs, outputs and gradients over micro-batches, and every
parameter's gradient and value; a module's output is the next one's input, recorded twice, so about
a fifth of the tensors are links), then the same step as format 4 and format 3 wrote it
(`write_format4_copy` and `write_legacy_copy` of tests/faults/meta_rows.py, run as a child: a dataset
per tensor; and each carrying its metadata as an attribute). Times `RunReader(run)` (the whole index,
every file checked: format 5 checks its packs and every span at open) on each, interleaved round by
round, and reports medians and the ratio of format 3 to format 5, with where the new open's time goes.
Values are small: opening reads metadata only. Writes results/index_open.{md,json}.

    python benchmarks/index_open.py [--rounds 9] [--work /tmp/ttrace-index-open]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import h5py
import torch

from harness import run_harness
from ttrace_core.format.reader import RunReader, step_file_name
from ttrace_core.format.schema import Layout, RunManifest, TensorKey, TensorMeta, TensorStats
from ttrace_core.format.findings import FINDINGS
from ttrace_core.format.packs import checked_spans, refuse_foreign_objects
from ttrace_core.format.tensor_index import TENSOR_INDEX, read_rows
from ttrace_core.format.writer import RunWriter, write_manifest

RESULTS = Path(__file__).parent / "results"
NUM_LAYERS = 48
MODULES = ("input_layernorm", "self_attention.linear_qkv", "self_attention.core_attention", "self_attention.linear_proj",
           "self_attention", "pre_mlp_layernorm", "mlp.linear_fc1", "mlp.linear_fc2", "mlp")
"""A transformer layer's traced modules, in execution order: each one's output is the next one's input."""
PARAMETERS = ("input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_qkv.weight",
              "self_attention.linear_qkv.bias", "self_attention.linear_qkv.layer_norm_weight",
              "self_attention.linear_proj.weight", "self_attention.linear_proj.bias", "self_attention.q_layernorm.weight",
              "self_attention.k_layernorm.weight", "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
              "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc2.weight",
              "mlp.linear_fc2.bias", "mlp.router.weight", "mlp.experts.weight1", "mlp.experts.weight2",
              "mlp.shared_experts.weight1", "mlp.shared_experts.weight2")
NUM_MICRO_BATCHES = 8
TARGET = 10.0


def _layout(shape: tuple[int, ...]) -> Layout:
    return Layout(global_shape=(shape[0] * 2, *shape[1:]), mesh_shape=(2,), coordinate=(0,), placements=("S(0)",),
                  mesh_axis_names=("tp",))


def _meta(key: TensorKey, value: torch.Tensor, seq: int) -> TensorMeta:
    stats = TensorStats(numel=value.numel(), sum=float(value.sum()), sumsq=float(value.square().sum()),
                        min=float(value.min()), max=float(value.max()), num_nan=0, num_inf=0)
    return TensorMeta(key=key, rank=0, dtype="float32", local_shape=tuple(value.shape), layout=_layout(tuple(value.shape)),
                      seq=seq, stats=stats)


def _step_tensors() -> list[tuple[TensorKey, torch.Tensor]]:
    """(key, value) in recording order; an output and the next module's input are one tensor object."""
    generator = torch.Generator().manual_seed(0)
    tensors = []
    for micro_batch in range(NUM_MICRO_BATCHES):
        for phase, into, out in (("forward", "input.0", "output.0"), ("backward", "grad_output.0", "grad_input.0")):
            flowing = torch.randn(4, 16, generator=generator)
            for layer in range(NUM_LAYERS):
                for module in MODULES:
                    fqn = f"decoder.layers.{layer}.{module}"
                    tensors.append((TensorKey(step=0, micro_batch=micro_batch, phase=phase, fqn=fqn, slot=into), flowing))
                    flowing = torch.randn(4, 16, generator=generator)
                    tensors.append((TensorKey(step=0, micro_batch=micro_batch, phase=phase, fqn=fqn, slot=out), flowing))
    for layer in range(NUM_LAYERS):
        for parameter in PARAMETERS:
            for phase, slot in (("grad", "grad"), ("param", "value")):
                key = TensorKey(step=0, micro_batch=-1, phase=phase, fqn=f"decoder.layers.{layer}.{parameter}", slot=slot)
                tensors.append((key, torch.randn(4, 16, generator=generator)))
    return tensors


def write_run(run_dir: Path) -> tuple[int, int]:
    """The run as RunWriter writes it (format 5); (tensors, links)."""
    write_manifest(run_dir, RunManifest(role="candidate", world_size=1, degrees={"tp": 1}))
    writer = RunWriter(run_dir, 0)
    writer.begin_step(0)
    tensors = _step_tensors()
    for seq, (key, value) in enumerate(tensors):
        writer.write(_meta(key, value, seq), value)
    writer.end_step()
    return len(tensors), writer.num_links_written


def open_seconds(run_dir: Path) -> tuple[float, int]:
    started = time.perf_counter()
    with RunReader(run_dir) as reader:
        seconds = time.perf_counter() - started
        return seconds, sum(len(metas) for metas in reader.index.values())


def new_open_parts(run_dir: Path) -> dict[str, float]:
    """Seconds of the new open's two walks over the file, apart (the rest is placing rows in the index)."""
    path = run_dir / step_file_name(0, 0)
    with h5py.File(path, "r") as handle:
        started = time.perf_counter()
        refuse_foreign_objects(handle, str(path), (TENSOR_INDEX, FINDINGS))
        names = time.perf_counter() - started
        started = time.perf_counter()
        rows = read_rows(handle, str(path))
        decoded = time.perf_counter() - started
        started = time.perf_counter()
        checked_spans(handle, rows, str(path), "")
        return {"link walk (every object one a format-5 file holds)": names, "index read + decode": decoded,
                "packs and spans checked": time.perf_counter() - started}


def measure(work: Path, rounds: int) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    new_dir, four_dir, old_dir = work / "format5", work / "format4", work / "format3"
    num_tensors, num_links = write_run(new_dir)
    run_harness("tests.faults.meta_rows", str(new_dir), str(four_dir), "--format", "4")  # write_format4_copy, in a child
    run_harness("tests.faults.meta_rows", str(new_dir), str(old_dir))  # write_legacy_copy, in a child
    seconds: dict[str, list[float]] = {"format 3 (attribute per dataset)": [], "format 4 (tensor index, a dataset per tensor)": [],
                                       "format 5 (tensor index, packs)": []}
    runs = (old_dir, four_dir, new_dir)
    parts: dict[str, list[float]] = {}
    for index in range(rounds):
        order = list(zip(seconds, runs))
        for name, run in order if index % 2 == 0 else order[::-1]:  # alternate which goes first
            took, indexed = open_seconds(run)
            assert indexed == num_tensors, (name, indexed, num_tensors)
            seconds[name].append(took)
        for part, took in new_open_parts(new_dir).items():
            parts.setdefault(part, []).append(took)
    old, _, new = (statistics.median(values) for values in seconds.values())
    return {"num_tensors": num_tensors, "num_links": num_links, "rounds": rounds,
            "file_mib": {name: (run / step_file_name(0, 0)).stat().st_size / 2**20 for name, run in zip(seconds, runs)},
            "median_s": {name: statistics.median(values) for name, values in seconds.items()},
            "all_s": seconds, "new_open_parts_median_s": {part: statistics.median(v) for part, v in parts.items()},
            "speedup": old / new, "target": TARGET}


def render(result: dict) -> str:
    lines = ["# Opening a large run: tensor index (formats 5 and 4) against an attribute per dataset (format 3)", "",
             f"`python benchmarks/index_open.py --rounds {result['rounds']}`: one rank's step of "
             f"{result['num_tensors']:,} tensors (a 48-layer run's count; {result['num_links']:,} of them recorded twice "
             "and stored once), written through RunWriter (format 5), and the same step rewritten as format 4 and as "
             "format 3 wrote it. "
             "`RunReader(run)` (the whole index) timed on each, interleaved round by round, warm page cache; medians. "
             "2 shared CPU cores: single timings vary 2x, the ratio is what counts.", "",
             "| format | open (s, median) | step file (MiB) |", "| --- | --- | --- |"]
    for name, median in result["median_s"].items():
        lines.append(f"| {name} | {median:.3f} | {result['file_mib'][name]:.1f} |")
    met = "met" if result["speedup"] >= result["target"] else "**not met**"
    lines += ["", f"Format 5 opens **{result['speedup']:.1f}x faster** than format 3 (target >= {result['target']:.0f}x: "
              f"{met}); load average {os.getloadavg()[0]:.1f} when it ended.", "",
              "Where the new open's time goes (medians, measured apart):", ""]
    lines += [f"- {part}: {seconds * 1000:.0f} ms" for part, seconds in result["new_open_parts_median_s"].items()]
    lines += ["- the rest: blind spots, findings and inventory attributes, and placing each row in the index "
              "(one string comparison per row when the row tells the truth)", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ttrace-index-open"))
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = measure(args.work, args.rounds)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "index_open.json").write_text(json.dumps(result, indent=2) + "\n")
    text = render(result)
    (args.results / "index_open.md").write_text(text)
    print(text)
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
