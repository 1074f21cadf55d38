"""The user-script walk of docs/your-own-script.md, run as written: what a user who types its commands sees.

Runs each command of the walk (recording tests/user_script/train_traced.py as the reference on 1 rank and as
a TP 2 x FSDP2 candidate on 4, the perturbation estimate, compare, the same candidate with `--bug`, compare
and localize) in a fresh work directory, where `tests` links to this checkout's, and keeps what each printed:
the exit codes, the tensors that pass, the first divergence and the culprits localize names. Writes
results/walkthrough.md (the commands in a code block, which the doc repeats, and the figures) and
walkthrough.json.

    python benchmarks/walkthrough.py [--work /tmp/ttrace-bench-walkthrough]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SCRIPT = "tests/user_script/train_traced.py"
REF = f"ttrace record --out runs/ref -- torchrun --standalone --nproc-per-node 1 {SCRIPT}"
CAND = f"ttrace record --out runs/cand -- torchrun --standalone --nproc-per-node 4 {SCRIPT} --tp 2 --dp 2 --checkpoint"
# The bug run gets a folder of its own: `ttrace record` refuses one that already holds a trace.
BUG = CAND.replace("runs/cand", "runs/bug") + " --bug"
WALK = {
    "reference": REF,
    "candidate": CAND,
    "estimate and compare": "ttrace estimate runs/ref && ttrace compare runs/ref runs/cand",
    "bug": BUG,
    "compare the bug": "ttrace compare runs/ref runs/bug",
    "localize the bug": "ttrace localize runs/ref runs/bug",
}


def run(command: str, work: Path) -> dict:
    started = time.perf_counter()
    done = subprocess.run(["bash", "-c", command], cwd=work, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=3600)
    return {"command": command, "exit": done.returncode, "seconds": round(time.perf_counter() - started, 1),
            "stdout": done.stdout, "stderr_tail": done.stderr[-2000:]}


def verdict_line(stdout: str) -> str:
    """The verdict's last line ("PASSED (equivalent) | 578/578 tensors pass ..."), not a table row's status."""
    return next((line for line in reversed(stdout.splitlines()) if line.startswith(("PASSED (", "FAILED ("))), "")


def first_divergence(stdout: str) -> str:
    """The tensor of the row under "first divergence (execution order):" in compare's report."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("first divergence")), None)
    if start is None or start + 2 >= len(lines):
        return ""
    match = re.search(r"(step \d+ / .*?)(?:  -- |$)", lines[start + 2])
    return match.group(1).strip() if match else ""


def figures(steps: dict, work: Path) -> dict:
    """What the walk's outputs say; the counts and culprits from the JSON `--json` gives for the same (cached) runs."""
    def compare_json(cand: str) -> dict:
        done = subprocess.run(["ttrace", "compare", "runs/ref", cand, "--json", "-"], cwd=work, capture_output=True, text=True)
        return json.loads(done.stdout)

    clean = compare_json("runs/cand")
    localized = subprocess.run(["ttrace", "localize", "runs/ref", "runs/bug", "--json", "-"], cwd=work,
                               capture_output=True, text=True)
    culprits = json.loads(localized.stdout).get("culprits", [])
    return {
        "clean_verdict": verdict_line(steps["estimate and compare"]["stdout"]),
        "clean_exit": steps["estimate and compare"]["exit"],
        "clean_tensors": clean["coverage"]["compared_elementwise"],
        "clean_passed": clean["passed"],
        "bug_exit": steps["compare the bug"]["exit"],
        "bug_verdict": verdict_line(steps["compare the bug"]["stdout"]),
        "bug_first_divergence": first_divergence(steps["compare the bug"]["stdout"]),
        "localize_exit": steps["localize the bug"]["exit"],
        "culprits": culprits,
    }


def markdown(steps: dict, found: dict) -> str:
    block = "\n".join(steps[name]["command"] for name in WALK)
    lines = [
        "# The user-script walk (docs/your-own-script.md), run as written",
        "",
        "`python benchmarks/walkthrough.py`: each command in a fresh directory, in this order.",
        "",
        "```bash",
        block,
        "```",
        "",
        "| command | exit | seconds |",
        "| --- | --- | --- |",
        *(f"| {name} | {steps[name]['exit']} | {steps[name]['seconds']} |" for name in WALK),
        "",
        f"- clean candidate: `{found['clean_verdict']}` (exit {found['clean_exit']})",
        f"- with `--bug`: `{found['bug_verdict']}` (exit {found['bug_exit']}); first divergence "
        f"`{found['bug_first_divergence']}`",
        f"- localize (exit {found['localize_exit']}) names: {', '.join(f'`{c}`' for c in found['culprits']) or 'none'}",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/ttrace-bench-walkthrough"))
    parser.add_argument("--render", action="store_true",
                        help="write the results again from walkthrough.json's outputs and the runs left in --work")
    args = parser.parse_args()
    if args.render:
        steps = json.loads((RESULTS / "walkthrough.json").read_text())["steps"]
    else:
        shutil.rmtree(args.work, ignore_errors=True)
        args.work.mkdir(parents=True)
        (args.work / "tests").symlink_to(ROOT / "tests")
        steps = {}
        for name, command in WALK.items():
            steps[name] = run(command, args.work)
            print(f"{name}: exit {steps[name]['exit']} in {steps[name]['seconds']} s", flush=True)
    found = figures(steps, args.work)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "walkthrough.json").write_text(json.dumps({"steps": steps, "figures": found}, indent=1) + "\n")
    (RESULTS / "walkthrough.md").write_text(markdown(steps, found))
    print(markdown(steps, found))


if __name__ == "__main__":
    main()
