"""Regenerate the sample traces listed in samples.json (deterministic: fixed seed, CPU, gloo).

    python sample_traces/make_samples.py                    # every sample
    python sample_traces/make_samples.py fp8/reference ...  # only these

Each sample is a megatron-core run of `ttrace example megatron-gpt` (MODEL_FLAGS plus the sample's
own flags) recorded into sample_traces/<name>; a sample with "estimate": true then gets
`ttrace estimate`, whose tolerance_estimate.json its candidates are compared with. The model is
small (2 layers, hidden 16, SwiGLU, 1 step) so that the traces can live in the repository as golden
cases for tests/test_sample_traces.py and ready-made input for the dashboard.

A recorded run's manifest names the command that relaunches it (`ttrace estimate`, the dashboard's
replay), with this interpreter's absolute path and the directory it ran in. A sample is relaunched
from a clone anywhere, so its manifest names `python` and no directory instead (`python -m
ttrace_examples` is found from any directory wherever ttrace is installed).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL_FLAGS = ["--num-layers", "2", "--hidden-size", "16", "--swiglu", "--steps", "1", "--seed", "0"]
# One intra-op thread per rank: the 2-rank runs then use the 2 cores without oversubscribing them. `python`
# (the samples' relaunch command, below) is this interpreter.
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}


def ttrace(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "ttrace_core", *args], check=True, env=ENV)


def size_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def make_portable(run_dir: Path) -> None:
    """The manifest's relaunch command with `python` for this interpreter's path and no working directory
    (the relaunch then runs in its caller's), so a clone anywhere can replay and estimate the sample."""
    path = run_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    command = manifest["entrypoint"]["command"]
    assert command[:3] == [sys.executable, "-m", "ttrace_examples"], command
    manifest["entrypoint"] |= {"command": ["python", *command[1:]], "cwd": ""}
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True))  # as the writer writes it


def make_sample(sample: dict) -> None:
    out = HERE / sample["name"]
    shutil.rmtree(out, ignore_errors=True)
    ttrace("example", "megatron-gpt", *MODEL_FLAGS, *sample["flags"], "--out", str(out))
    make_portable(out)
    if sample.get("estimate", False):
        ttrace("estimate", str(out))
    print(f"{sample['name']}: {size_mib(out):.2f} MiB", flush=True)


def main(names: list[str]) -> None:
    samples = json.loads((HERE / "samples.json").read_text())
    unknown = set(names) - {s["name"] for s in samples}
    if unknown:
        raise SystemExit(f"not in samples.json: {', '.join(sorted(unknown))}")
    start = time.perf_counter()
    for sample in samples:
        if not names or sample["name"] in names:
            make_sample(sample)
    print(f"done in {time.perf_counter() - start:.0f} s; sample_traces/ holds {size_mib(HERE):.1f} MiB")


if __name__ == "__main__":
    main(sys.argv[1:])
