"""Regenerate the sample traces listed in samples.json (deterministic: fixed seed, CPU, gloo).

    python sample_traces/make_samples.py                    # every sample
    python sample_traces/make_samples.py fp8/reference ...  # only these

Each sample is a megatron-core run of `ttrace example megatron-gpt` (MODEL_FLAGS plus the sample's
own flags) recorded into sample_traces/<name>; a sample with "estimate": true then gets
`ttrace estimate`, whose tolerance_estimate.json its candidates are compared with. The model is
small (2 layers, hidden 16, 1 step) so that the traces can live in the repository as golden cases
for tests/test_sample_traces.py and ready-made input for the dashboard.
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
MODEL_FLAGS = ["--num-layers", "2", "--hidden-size", "16", "--steps", "1", "--seed", "0"]
# One intra-op thread per rank: the 2-rank runs then use the 2 cores without oversubscribing them.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def ttrace(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "ttrace_core", *args], check=True, env=ENV)


def size_mib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def make_sample(sample: dict) -> None:
    out = HERE / sample["name"]
    shutil.rmtree(out, ignore_errors=True)
    ttrace("example", "megatron-gpt", *MODEL_FLAGS, *sample["flags"], "--out", str(out))
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
