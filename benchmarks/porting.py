"""What an independent reference catches that a same-code reference cannot: model bugs in a megatron-core
port of Llama, judged against transformers' Llama and against megatron itself on one rank, side by side.

The candidate is `ttrace example megatron-gpt --llama --num-query-groups 2` (4 layers, hidden 64, 4 heads
in 2 query groups, fp32, 1 step of 4 micro-batches), at TP1 and at TP2 + SP, clean and with each model-code
bug of ttrace_examples/megatron_gpt/model_bugs.py (`ttrace bugs` lists them). Two references:

- HF: `ttrace example hf-llama` (LlamaForCausalLM from LlamaConfig, same weights through the map), estimated,
  compared through `--map hf-llama--megatron-gpt`; a failing candidate is localized against it;
- same code: the megatron candidate's own script on one process, with the same bug (the porter's code is
  the same in both), estimated. The TP1 candidate is that run itself, so its row has no same-code verdict.

The MoE suite does the same for a megatron-core MoE port against transformers' Mixtral
(`ttrace example megatron-gpt --llama --num-query-groups 2 --moe --num-experts 4`, top-2, at TP1 and at
DP2 x EP2; `ttrace example hf-llama --moe`, `--map hf-mixtral--megatron-gpt-moe`), clean and with the routing bug.
The bf16 suite repeats the Llama suite in bf16 (`--precision bf16` on both sides: bf16 parameters and compute,
fp32 gradients and main weights), where the map's declared precision choices are named with the verdict.

The torchtitan suite judges torchtitan 0.3.0's llama3, run by torchtitan's own Trainer (debug model, 2 steps of 2
micro-batches of 2 x 64 tokens, fp32), against transformers' Llama trained as the Trainer trains it
(`python -m ttrace_examples.hf_llama.torchtitan_reference`, `--map hf-llama--torchtitan-llama3`), at one rank and at
TP2, clean and with each bug of ttrace_examples/torchtitan/model_bugs.py; porting_float64.py beside it checks that
the two implementations agree in float64.

Writes results/porting.{md,json}; docs/porting.md quotes the tables. `--only SUITE` runs one suite and keeps
the other's rows from results/porting.json (each row names its suite and the versions it was measured with).

    python benchmarks/porting.py [--only llama|bf16|moe|torchtitan] [--work /var/tmp/ttrace-porting] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
MAP = "hf-llama--megatron-gpt"
MODEL = ["--num-query-groups", "2"]
LAYOUTS = {"TP1": [], "TP2+SP": ["--tp", "2", "--sp"]}
BUGS = [None, "proj-transposed", "rotary-interleaved", "gqa-tiled-groups", "norm-eps-outside-sqrt"]
MOE = [*MODEL, "--moe", "--num-experts", "4"]
SUITES = {
    "llama": {"map": MAP, "hf": MODEL, "candidate": ["--llama", *MODEL], "layout": ("TP2+SP", LAYOUTS["TP2+SP"]),
              "bugs": BUGS},
    "bf16": {"map": MAP, "hf": [*MODEL, "--precision", "bf16"], "candidate": ["--llama", *MODEL, "--precision", "bf16"],
             "layout": ("TP2+SP", LAYOUTS["TP2+SP"]), "bugs": BUGS},
    "moe": {"map": "hf-mixtral--megatron-gpt-moe", "hf": MOE, "candidate": ["--llama", *MOE],
            "layout": ("DP2+EP2", ["--dp", "2", "--ep", "2"]), "bugs": [None, "router-topk-unnormalized"]},
    "torchtitan": {"map": "hf-llama--torchtitan-llama3", "layout": ("TP2", ["--parallelism.tensor_parallel_degree", "2"]),
                   "bugs": [None, "rotary-half-split", "norm-eps-outside-sqrt"]},
}
"""Per suite: the map, the flags of `ttrace example hf-llama` and of the megatron candidate, the parallel
layout beside TP1, and the bugs (None: the clean port). The torchtitan suite takes torchtitan's own arguments,
TORCHTITAN, on both sides."""
TORCHTITAN = ["--module", "ttrace_examples.torchtitan", "--config", "llama3_debugmodel", "--training.steps", "2",
              "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.global_batch_size", "4",
              "--training.mixed_precision_param", "float32"]


def ttrace(work: Path, *args: str, timeout: float = 1800) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ttrace_core", *args], cwd=work, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return done, time.perf_counter() - started


def checked(work: Path, *args: str) -> float:
    done, seconds = ttrace(work, *args)
    if done.returncode != 0:
        raise SystemExit(f"ttrace {' '.join(args)} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    print(f"  {seconds:5.0f} s  ttrace {' '.join(args)}", flush=True)
    return seconds


def compare(work: Path, reference: str, candidate: str, *, map_name: str | None) -> dict:
    out = work / f"compare-{reference}-{candidate}.json"
    done, seconds = ttrace(work, "compare", reference, candidate, "--json", str(out),
                           *(["--map", map_name] if map_name else []))
    if done.returncode not in (0, 1):
        raise SystemExit(f"compare {reference} {candidate}: exit {done.returncode}\n{done.stderr[-2000:]}")
    result = json.loads(out.read_text())
    failing = [c for c in result["comparisons"] if c["status"] != "pass"]
    first = failing[0] if failing else None
    coverage = result.get("coverage") or {}
    return {"verdict": result["verdict"], "seconds": round(seconds, 1), "num_tensors": len(result["comparisons"]),
            "precision_choices": [n for n in result.get("notes", []) if n.startswith("precision-choice")],
            "num_failing": len(failing), "unmapped": coverage.get("unmapped", 0),
            "first_divergence": None if first is None else
            f"{first['key']['phase']} / {first['key']['fqn']} / {first['key']['slot']}",
            "first_ratio": None if first is None else first.get("ratio"),
            "first_status": None if first is None else first["status"],
            "max_ratio": max((c["ratio"] for c in result["comparisons"] if c.get("ratio") is not None), default=None)}


def _torchtitan_localized_correctly(bug: str, result) -> bool:
    import fnmatch

    from ttrace_examples.torchtitan.model_bugs import CULPRITS

    first = next((m.fqn for m in result.modules if m.verdict == "introduces error"), None)
    return first is not None and any(fnmatch.fnmatchcase(first, glob) for glob in CULPRITS[bug])


def localize(work: Path, hf: str, candidate: str, bug: str, map_name: str, *, suite: str = "llama") -> dict:
    from ttrace_core.localize.verdicts import Localization
    from ttrace_examples.megatron_gpt.bugs import localized_correctly

    out = work / f"localize-{candidate}.json"
    done, seconds = ttrace(work, "localize", hf, candidate, "--map", map_name, "--json", str(out))
    if not out.exists():
        return {"culprits": [], "exit": done.returncode, "seconds": round(seconds, 1), "correct": False,
                "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    result = Localization.from_json(out.read_text())
    return {"culprits": result.culprits, "exit": done.returncode, "seconds": round(seconds, 1),
            "correct": (_torchtitan_localized_correctly if suite == "torchtitan" else localized_correctly)(bug, result),
            "notes": result.notes}


def _record_torchtitan(work: Path, out: str, nproc: int, bug: str | None) -> float:
    module = ["ttrace_examples.torchtitan.model_bugs", "--bug", bug] if bug else ["ttrace_examples.torchtitan"]
    layout = SUITES["torchtitan"]["layout"][1] if nproc > 1 else []
    return checked(work, "record", "--out", out, "--", "torchrun", "--standalone", "--nproc-per-node", str(nproc),
                   "-m", *module, *TORCHTITAN, *layout)


def run_torchtitan(work: Path) -> dict:
    """As `run`, with torchtitan's Trainer as the candidate and its arguments given to the HF reference too."""
    spec, suite = SUITES["torchtitan"], "torchtitan"
    layout = spec["layout"][0]
    print(f"{suite}: recording (HF reference, then per bug: the one-rank run and the {layout} candidate)", flush=True)
    seconds = {"torchtitan hf": checked(work, "record", "--out", "tt-hf", "--", sys.executable, "-m",
                                        "ttrace_examples.hf_llama.torchtitan_reference", *TORCHTITAN),
               "torchtitan estimate hf": checked(work, "estimate", "tt-hf")}
    rows = []
    for bug in spec["bugs"]:
        name = bug or "clean"
        ref, parallel = f"tt-tp1-{name}", f"tt-tp2-{name}"
        seconds[f"torchtitan TP1 {name}"] = _record_torchtitan(work, ref, 1, bug)
        seconds[f"torchtitan estimate {name}"] = checked(work, "estimate", ref)
        seconds[f"torchtitan {layout} {name}"] = _record_torchtitan(work, parallel, 2, bug)
        for layout_name, candidate in (("TP1", ref), (layout, parallel)):
            row = {"suite": suite, "bug": name, "layout": layout_name, "hf": compare(work, "tt-hf", candidate, map_name=spec["map"])}
            row["same_code"] = None if layout_name == "TP1" else compare(work, ref, candidate, map_name=None)
            row["localized"] = localize(work, "tt-hf", candidate, bug, spec["map"], suite=suite) \
                if bug and row["hf"]["verdict"] != "equivalent" else None
            rows.append(row)
            print(f"  {name:<24} {layout_name:<7} HF {row['hf']['verdict']:<15} same code "
                  f"{(row['same_code'] or {}).get('verdict', '-'):<15} culprit {(row['localized'] or {}).get('culprits')}",
                  flush=True)
    started = time.perf_counter()
    float64 = work / "float64.json"
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "porting_float64.py"), "--json", str(float64)],
                          cwd=work, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"porting_float64.py exited {done.returncode}:\n{done.stderr[-2000:]}")
    seconds["torchtitan float64"] = time.perf_counter() - started
    return {"rows": rows, "seconds": {k: round(v, 1) for k, v in seconds.items()},
            "float64": json.loads(float64.read_text())}


def run(work: Path, suite: str) -> dict:
    if suite == "torchtitan":
        return run_torchtitan(work)
    spec = SUITES[suite]
    hf, prefix = ("hf", "") if suite == "llama" else (f"hf-{suite}", f"{suite}-")
    layout, layout_flags = spec["layout"]
    print(f"{suite}: recording (HF reference, then per bug: the same-code reference and the {layout} candidate)", flush=True)
    seconds = {f"{prefix}hf": checked(work, "example", "hf-llama", *spec["hf"], "--out", hf),
               f"{prefix}estimate hf": checked(work, "estimate", hf)}
    rows = []
    for bug in spec["bugs"]:
        name = bug or "clean"
        flags = spec["candidate"] + (["--bug", bug] if bug else [])
        ref, parallel = f"{prefix}ref-{name}", f"{prefix}{layout.lower().replace('+', '')}-{name}"
        seconds[f"{prefix}ref {name}"] = checked(work, "example", "megatron-gpt", *flags, "--out", ref)
        seconds[f"{prefix}estimate {name}"] = checked(work, "estimate", ref)
        seconds[f"{prefix}{layout} {name}"] = checked(work, "example", "megatron-gpt", *flags, *layout_flags, "--out", parallel)
        for layout_name, candidate in (("TP1", ref), (layout, parallel)):
            row = {"suite": suite, "bug": name, "layout": layout_name,
                   "hf": compare(work, hf, candidate, map_name=spec["map"])}
            row["same_code"] = None if layout_name == "TP1" else compare(work, ref, candidate, map_name=None)
            row["localized"] = localize(work, hf, candidate, bug, spec["map"]) \
                if bug and row["hf"]["verdict"] != "equivalent" else None
            rows.append(row)
            print(f"  {name:<24} {layout_name:<7} HF {row['hf']['verdict']:<15} same code "
                  f"{(row['same_code'] or {}).get('verdict', '-'):<15} culprit {(row['localized'] or {}).get('culprits')}",
                  flush=True)
    return {"rows": rows, "seconds": {k: round(v, 1) for k, v in seconds.items()}}


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _environment(env: dict) -> str:
    trainer = f"torchtitan {env['torchtitan']}" if "torchtitan" in env else f"megatron-core {env['megatron_core']}"
    return (f"{trainer}, transformers {env['transformers']}, torch {env['torch']}, "
            f"Python {env['python']}; {env['machine']}")


def _table(rows: list[dict], parallel: str) -> list[str]:
    lines = [
        "| bug | layout | vs HF: verdict | first divergence | ratio | culprit (localize) | vs same code: verdict |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        hf, same, loc = row["hf"], row["same_code"], row["localized"]
        culprit = "-" if loc is None else (", ".join(loc["culprits"][:2]) or "none") + (" (correct)" if loc["correct"] else " (wrong)")
        lines.append(f"| {row['bug']} | {row['layout']} | {hf['verdict']} ({hf['num_tensors'] - hf['num_failing']}/"
                     f"{hf['num_tensors']} pass) | {hf['first_divergence'] or '-'} | {_number(hf['first_ratio'])} | {culprit} | "
                     f"{'-' if same is None else same['verdict'] + ' (' + str(same['num_tensors'] - same['num_failing']) + '/' + str(same['num_tensors']) + ' pass)'} |")
    caught = [r for r in rows if r["bug"] != "clean"]
    return lines + [
        "",
        f"Against HF: {sum(r['hf']['verdict'] != 'equivalent' for r in caught)}/{len(caught)} bug rows fail, "
        f"{sum(bool(r['localized'] and r['localized']['correct']) for r in caught)}/{len(caught)} localized to the bug's "
        f"module; clean rows: {', '.join(r['hf']['verdict'] for r in rows if r['bug'] == 'clean')}. "
        f"Against the same code ({parallel}): {sum(r['same_code']['verdict'] == 'equivalent' for r in caught if r['same_code'])}/"
        f"{sum(1 for r in caught if r['same_code'])} bug rows pass.",
        "",
        "Largest ratio (error / tolerance) of a clean row against HF: " + ", ".join(
            f"{r['layout']} {_number(r['hf']['max_ratio'])}" for r in rows if r["bug"] == "clean") + "; "
        "tensors without counterpart through the map (listed by reason in the coverage, not compared): " + ", ".join(
            f"{r['layout']} {r['hf']['unmapped']}" for r in rows if r["bug"] == "clean") + ".",
    ]


def markdown(results: dict) -> str:
    environments = results.get("environments") or {"llama": results}
    rows = {suite: [r for r in results["rows"] if r.get("suite", "llama") == suite] for suite in SUITES}
    lines = [
        "# Model bugs against an independent reference (HF Llama) and against the same code",
        "",
        f"`python benchmarks/porting.py`: {_environment(environments['llama'])}.",
        "",
        "Candidate: `ttrace example megatron-gpt --llama --num-query-groups 2` (4 layers, hidden 64, 4 heads in 2 query "
        "groups, fp32, 1 step of 4 micro-batches) with the bug. References, each estimated (`ttrace estimate`, 4 samples): "
        f"HF, `ttrace example hf-llama`, compared with `--map {MAP}`; same code, the candidate's script with the same bug on "
        "one process (the TP1 candidate is that run, so it has no same-code verdict). Culprit: `ttrace localize` against "
        "HF; \"correct\" when it names the bug's module (bugs.MODEL_CODE_CULPRITS).",
        "",
        *_table(rows["llama"], "TP2+SP"),
    ]
    if rows["bf16"]:
        choices = sorted({c for r in rows["bf16"] for c in r["hf"].get("precision_choices", [])})
        lines += [
            "",
            "## bf16: the same, both sides in bf16",
            "",
            f"`python benchmarks/porting.py --only bf16`: {_environment(environments['bf16'])}.",
            "",
            "Candidate and references as above with `--precision bf16` on every run: megatron's Float16Module with fp32 "
            "main gradients and main weights; HF's model in bf16 with the same (`ttrace example hf-llama --precision bf16`). "
            "Tolerances come from each reference's own estimate in bf16.",
            "",
            *_table(rows["bf16"], "TP2+SP"),
            "",
            f"Precision choices the map declares, named with every HF verdict ({len(choices)}):",
            *(f"- {choice}" for choice in choices),
        ]
    if rows["moe"]:
        moe = SUITES["moe"]
        lines += [
            "",
            "## MoE: HF Mixtral against megatron-core's MoE",
            "",
            f"`python benchmarks/porting.py --only moe`: {_environment(environments['moe'])}.",
            "",
            "Candidate: `ttrace example megatron-gpt --llama --num-query-groups 2 --moe --num-experts 4` (4 layers, hidden "
            "64, 4 experts of top-2 routing with SequentialMLP experts and the allgather dispatcher, fp32, 1 step of 4 "
            "micro-batches) with the bug, at TP1 and at DP2 x EP2 (each EP rank holds 2 experts). References, each "
            f"estimated: HF, `ttrace example hf-llama --moe` (MixtralForCausalLM), compared with `--map {moe['map']}`; same "
            "code as above.",
            "",
            *_table(rows["moe"], "DP2+EP2"),
        ]
    if rows["torchtitan"]:
        titan, float64 = SUITES["torchtitan"], environments["torchtitan"]["float64"]
        lines += [
            "",
            "## torchtitan: HF Llama against torchtitan's llama3",
            "",
            f"`python benchmarks/porting.py --only torchtitan`: {_environment(environments['torchtitan'])}.",
            "",
            "Candidate: torchtitan's own Trainer (`torchrun -m ttrace_examples.torchtitan`, llama3 debug model: 6 layers, "
            "dim 256, 16 heads, 2 steps of 2 micro-batches of 2 x 64 tokens, chunked loss, fp32) with the bug "
            "(`-m ttrace_examples.torchtitan.model_bugs --bug NAME`), at one rank and at TP2 (sequence and loss parallel). "
            "References, each estimated: HF, `python -m ttrace_examples.hf_llama.torchtitan_reference` with the same "
            f"arguments, compared with `--map {titan['map']}`; same code, the candidate with the same bug on one rank.",
            "",
            *_table(rows["torchtitan"], "TP2"),
            "",
            "The two implementations in float64 (`benchmarks/porting_float64.py`: one micro-batch through both from the "
            "same weights, HF's float32 softmax and norm and both sides' float32 rotary angles lifted to float64): "
            + "; ".join(f"{dtype}: final hidden states differ by {_number(m['hidden_relative'])} (relative), the largest "
                        f"parameter gradient difference {_number(m['max_gradient_relative'])} ({m['max_gradient']})"
                        for dtype, m in float64.items()) + ".",
        ]
    seconds = {k: v for env in environments.values() for k, v in env.get("seconds", {}).items()}
    lines += ["", "Time (s): " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=None, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the runs")
    parser.add_argument("--only", choices=sorted(SUITES), default=None,
                        help="run one suite; the other's rows are kept from results/porting.json")
    parser.add_argument("--render", action="store_true", help="rewrite porting.md from porting.json (no run)")
    args = parser.parse_args()
    if args.render:
        (RESULTS / "porting.md").write_text(markdown(json.loads((RESULTS / "porting.json").read_text())))
        return
    import megatron.core
    import torch
    import transformers

    previous = json.loads((RESULTS / "porting.json").read_text()) if args.only and (RESULTS / "porting.json").exists() else None
    environments = dict(previous.get("environments") or {"llama": {k: v for k, v in previous.items() if k != "rows"}}) \
        if previous else {}
    rows = [r for r in previous["rows"] if r.get("suite", "llama") != args.only] if previous else []
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="ttrace-porting-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        for suite in [args.only] if args.only else list(SUITES):
            measured = run(work, suite)
            rows += measured["rows"]
            environments[suite] = {
                "seconds": measured["seconds"], "megatron_core": megatron.core.__version__,
                "transformers": transformers.__version__, "torch": torch.__version__,
                "python": platform.python_version(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"}
            if suite == "torchtitan":
                import torchtitan

                environments[suite].update(torchtitan=torchtitan.__version__, float64=measured["float64"])
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for row in rows:
        row.setdefault("suite", "llama")
    results = {"rows": sorted(rows, key=lambda r: list(SUITES).index(r["suite"])), "environments": environments}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "porting.json").write_text(json.dumps(results, indent=1))
    (RESULTS / "porting.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
