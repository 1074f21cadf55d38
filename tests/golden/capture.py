"""Capture the CLI's results on every sample pair, as the golden files `test_golden_outputs.py` checks.

    python tests/golden/capture.py     (from the repository root; rewrites tests/golden/*.json.gz)

Recorded once before the stage-packages move, so that the move (and any later refactor) is checked
against what the code gave before it: the `--json` output, the comparison table and the text verdict
of `ttrace compare`, and `ttrace inspect`, for every pair in sample_traces/samples.json.
"""

import gzip
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = Path(__file__).resolve().parent
SAMPLES_DIR = ROOT / "sample_traces"


def sample_pairs() -> list[tuple[str, str]]:
    samples = json.loads((SAMPLES_DIR / "samples.json").read_text())
    return [(s["reference"] or s["name"], s["name"]) for s in samples]


def run_outputs(reference: str, candidate: str) -> dict:
    """What the CLI prints and writes for one pair, run on copies (the cache goes to a fresh dir)."""
    with tempfile.TemporaryDirectory() as scratch:
        ref_dir, cand_dir = Path(scratch) / "ref", Path(scratch) / "cand"
        shutil.copytree(SAMPLES_DIR / reference, ref_dir, ignore=shutil.ignore_patterns(".ttrace"))
        shutil.copytree(SAMPLES_DIR / candidate, cand_dir, ignore=shutil.ignore_patterns(".ttrace"))
        json_path = Path(scratch) / "out.json"
        compare = subprocess.run([sys.executable, "-m", "ttrace_core", "compare", str(ref_dir), str(cand_dir),
                                  "--json", str(json_path)], capture_output=True, text=True, cwd=scratch)
        inspect = subprocess.run([sys.executable, "-m", "ttrace_core", "inspect", str(cand_dir)],
                                 capture_output=True, text=True, cwd=scratch)
        import pandas as pd

        (table_path,) = (cand_dir / ".ttrace" / "comparisons").glob("comparison-*.parquet")
        table = pd.read_parquet(table_path)
        return {
            "compare_exit": compare.returncode,
            "compare_stdout": compare.stdout.replace(scratch, "SCRATCH"),
            "inspect_exit": inspect.returncode,
            "inspect_stdout": inspect.stdout.replace(scratch, "SCRATCH"),
            "json": json.loads(json_path.read_text().replace(scratch, "SCRATCH")),
            "table_columns": list(table.columns),
            "table": json.loads(table.to_json(orient="records", double_precision=15)),
        }


def main() -> None:
    for reference, candidate in sample_pairs():
        name = candidate.replace("/", "__")
        text = json.dumps(run_outputs(reference, candidate), indent=0, sort_keys=True) + "\n"
        (GOLDEN_DIR / f"{name}.json.gz").write_bytes(gzip.compress(text.encode(), mtime=0))
        print(f"captured {candidate} against {reference}")


if __name__ == "__main__":
    main()
