"""Regenerate every sample trace listed in samples.json (deterministic: fixed seed, CPU, gloo).

    python sample_traces/make_samples.py

Samples are small (2 layers, d_model 32) so that they can live in the repository: they are golden
cases for tests (every sample still reads and gives its documented verdict) and ready-made input
for the dashboard.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL_FLAGS = ["--num-layers", "2", "--d-model", "32", "--steps", "1", "--seed", "0"]


def main() -> None:
    for sample in json.loads((HERE / "samples.json").read_text()):
        out = HERE / sample["name"]
        shutil.rmtree(out, ignore_errors=True)
        command = [sys.executable, "-m", "ttrace_core", "example", "torch-gpt", *sample["flags"], *MODEL_FLAGS, "--out", str(out)]
        subprocess.run(command, check=True)
        print(f"{sample['name']}: {sum(p.stat().st_size for p in out.iterdir()) / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
