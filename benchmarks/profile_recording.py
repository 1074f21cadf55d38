"""Where one recorded step's time goes, function by function: the recording_overhead.py testbed (megatron-core
GPT, TP over spawned gloo ranks), one warm-up step per mode, then one step per mode under cProfile on rank 0.
Writes results/<name>.md with the top functions by own time and by cumulative time (tracer and writer code).

    python benchmarks/profile_recording.py [--modes full stats-only] [--top 25] [--name profile_recording]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from ttrace_core.record.launch import run_ranks

RESULTS = Path(__file__).parent / "results"


def profile_ranks(config: dict) -> None:
    """The rank side: build the model, warm every mode up once, then profile one step per mode (rank 0 keeps it)."""
    import cProfile
    import pstats

    import torch.distributed as dist
    from ttrace_core.integrations import megatron_cpu
    from ttrace_examples.megatron_gpt.train import MegatronGPTRunConfig, _build

    from overhead_ranks import _one_step, _step_fn

    run = MegatronGPTRunConfig.from_dict(config["run"])
    out = Path(config["out"])
    megatron_cpu.enable()
    dist.init_process_group("gloo")
    try:
        ddp, optimizer, rename = _build(run)
        _step_fn(run, ddp, optimizer)()
        found = {}
        for mode in config["modes"]:
            _one_step(mode, run, ddp, optimizer, rename, out, 0)
            profile = cProfile.Profile()
            profile.enable()
            seconds = _one_step(mode, run, ddp, optimizer, rename, out, 1)[0]
            profile.disable()
            found[mode] = {"seconds": seconds, "functions": _functions(pstats.Stats(profile).stats)}
        if dist.get_rank() == 0:
            (out / "profile.json").write_text(json.dumps(found))
        dist.barrier()
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _functions(stats: dict) -> list[dict]:
    return [{"function": f"{Path(path).name}:{line}({name})", "path": path, "calls": entry[1], "own_s": entry[2],
             "cumulative_s": entry[3]} for (path, line, name), entry in stats.items()]


def _ours(row: dict) -> bool:
    return "ttrace_core" in row["path"] or "h5py" in row["path"]


def render(found: dict, top: int, setup: str) -> str:
    lines = [f"# Profile of one recorded step ({setup})", "",
             "cProfile on rank 0 (it inflates Python-heavy parts); seconds.", ""]
    for mode, profile in found.items():
        rows = profile["functions"]
        lines += [f"## {mode}: step {profile['seconds']:.3f} s (profiled)", "",
                  "### Top functions by own time (all code)", "", "| function | calls | own s | cumulative s |",
                  "|---|---|---|---|"]
        for row in sorted(rows, key=lambda r: -r["own_s"])[:top]:
            lines.append(f"| {row['function']} | {row['calls']} | {row['own_s']:.3f} | {row['cumulative_s']:.3f} |")
        lines += ["", "### Top tracer and writer functions by cumulative time", "",
                  "| function | calls | own s | cumulative s |", "|---|---|---|---|"]
        for row in sorted(filter(_ours, rows), key=lambda r: -r["cumulative_s"])[:top]:
            lines.append(f"| {row['function']} | {row['calls']} | {row['own_s']:.3f} | {row['cumulative_s']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["full", "stats-only"])
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--name", default="profile_recording")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    run = {"tp": 2, "sp": True, "num_micro_batches": 4, "micro_batch_size": 4,
           "model": {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "vocab_size": 1024, "seq_len": 128}}
    out = Path(tempfile.mkdtemp(prefix="ttrace-profile-", dir="/var/tmp"))
    try:
        sys.path.insert(0, str(Path(__file__).parent))
        run_ranks("profile_recording:profile_ranks", {"run": run, "out": str(out), "modes": args.modes}, 2,
                  timeout_s=1800, env={"OMP_NUM_THREADS": "1"})
        found = json.loads((out / "profile.json").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    text = render(found, args.top, "the recording_overhead.py testbed: megatron-core GPT, TP 2 + SP, 4 layers, hidden 256")
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"{args.name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
