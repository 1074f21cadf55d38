"""Detection benchmark: every zoo bug and every clean layout, in fp32, bf16 and fp8, judged by ttrace's
perturbation tolerances and by the usual alternatives (baselines.py) on the same traces.

For each precision and model variant (base, swiglu, tied embeddings, MoE) it records the
single-rank reference and estimates its tolerances (`ttrace estimate`), records an fp64 oracle
(Dynamo-style baseline), then records each clean layout and each bug in each layout that triggers
it. Every run trains --loss-steps steps (the loss-curve baseline) and traces the first two.
Writes results/detection.{md,csv}; runs are kept under --work and reused when complete.

    python benchmarks/detection.py [--precisions fp32,bf16,fp8] [--work /tmp/ttrace-detection]
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import baselines
from ttrace_core.compare.engine import compare_runs
from ttrace_core.compare.estimate_file import estimate_path
from ttrace_examples.megatron_gpt.bugs import ZOO, first_tensor_points_at, localized_correctly
from ttrace_core.workflows.localize import localize
from ttrace_core.format.reader import RunReader
from ttrace_core.compare.step_scalars import with_step_scalars
from ttrace_core.compare.tolerances import num_layers_of, select_tolerances

RESULTS = Path(__file__).parent / "results"
VARIANT_FLAGS = {"base": [], "swiglu": ["--swiglu"], "tied": ["--tie-embeddings"], "moe": ["--moe"]}
CLEAN_LAYOUTS = [("base", "--tp 2"), ("base", "--tp 2 --sp"), ("base", "--pp 2"), ("base", "--dp 2"),
                 ("base", "--dp 2 --dist-opt"), ("base", "--tp 2 --pp 2 --sp"), ("swiglu", "--tp 2"),
                 ("tied", "--pp 2"), ("moe", "--tp 2 --sp"), ("moe", "--dp 2 --ep 2")]
TORCH_GPT_PRECISIONS = ("fp32", "bf16")  # torch-gpt has no fp8 recipe


@dataclass(frozen=True)
class Split:
    """One model size, data and seed. ttrace's settings (alpha, the floor, the exact-inputs k) were
    chosen on `in-sample`; `held-out` is a model and data they never saw."""

    seed: int
    num_layers: int
    width: int
    seq_len: int
    micro_batches: int

    def flags(self, workload: str) -> list[str]:
        width = "--hidden-size" if workload == "megatron-gpt" else "--d-model"
        return ["--seed", str(self.seed), "--num-layers", str(self.num_layers), width, str(self.width),
                "--seq-len", str(self.seq_len), "--micro-batches", str(self.micro_batches)]

    def describe(self) -> str:
        return (f"{self.num_layers} layers, hidden {self.width}, {self.micro_batches} micro-batches of 2 x "
                f"{self.seq_len} tokens, seed {self.seed}")


SPLITS = {"in-sample": Split(seed=0, num_layers=4, width=64, seq_len=16, micro_batches=4),
          "held-out": Split(seed=1, num_layers=8, width=128, seq_len=32, micro_batches=2),
          "held-out-2": Split(seed=2, num_layers=6, width=96, seq_len=24, micro_batches=4)}
CLEAN_ONLY_SPLITS = {"held-out-2"}
"""Splits that only add clean runs: a second model size and seed for the false-alarm population."""


@dataclass(kw_only=True)
class Run:
    workload: str
    precision: str
    variant: str
    layout: str
    bug: str | None = None
    split: str = "in-sample"

    @property
    def name(self) -> str:
        slug = self.layout.replace("--", "").replace(" ", "") or "ref"
        return f"{self.bug or 'clean'}-{slug}"

    def directory(self, work: Path) -> Path:
        return work / self.split / self.workload / self.precision / self.variant / self.name

    def reference(self, precision: str | None = None) -> Run:
        return Run(workload=self.workload, precision=precision or self.precision, variant=self.variant, layout="",
                   split=self.split)

    def flags(self, loss_steps: int) -> list[str]:
        flags = [*shlex.split(self.layout), *VARIANT_FLAGS[self.variant], "--precision", self.precision,
                 *SPLITS[self.split].flags(self.workload)]
        if self.bug:
            flags += ["--bug", self.bug]
        if self.workload == "megatron-gpt":
            return flags + ["--steps", str(max(loss_steps, 2)), "--record-steps", "2"]
        return flags + ["--steps", "2"]


@dataclass(kw_only=True)
class Row:
    precision: str
    run: str
    variant: str
    layout: str
    detected: bool | None
    first_divergence: str
    first_ratio: float | None
    max_ratio: float | None
    ground_truth: str
    theorem: bool | None
    megatron_l0: bool | None
    assert_close: bool | None
    dynamo: bool | None
    loss_step: str
    localized_rewrite: str = "-"
    """Bug runs: does `ttrace localize` name the ground truth first ("yes"/"no", with what it named)."""
    localized_first_tensor: str = "-"
    """Bug runs: is the first failing tensor in the ground-truth module (or parameters)?"""
    note: str = ""
    first_error: float | None = None
    """Relative error at the first divergence, and the tolerance (rel) it was held to."""
    first_tolerance: float | None = None
    first_method: str = ""
    """How that tolerance was derived: perturbation, perturbation-floor, exact-inputs."""
    split: str = ""
    """Held-out rows: which held-out split ("held-out", or "held-out-2", the second size's clean runs)."""
    first_decided_by: str = ""
    """Which test gave the first divergence's ratio: mismatch (the norm), replica drift, scale, offset, update."""
    first_finding: str = ""
    """The transform that test read off the error ("scaled by 0.500 ..."), when a structure test decided."""
    max_norm: float | None = None
    """The largest ratio of each test over the run (clean runs: how close round-off came to each line)."""
    max_scale: float | None = None
    max_offset: float | None = None
    max_update: float | None = None
    max_bias: float | None = None
    max_shard: float | None = None


def bug_runs(precisions: list[str], split: str = "in-sample") -> list[Run]:
    runs = []
    for bug in ZOO.values():
        for trigger in bug.triggers:
            flags = shlex.split(trigger)
            pinned = flags[flags.index("--precision") + 1] if "--precision" in flags else None
            if pinned:
                del flags[flags.index("--precision"):flags.index("--precision") + 2]
            variant = next((v for v, f in VARIANT_FLAGS.items() if f and f[0] in flags), "base")
            layout = " ".join(f for f in flags if f not in VARIANT_FLAGS[variant])
            workload = "torch-gpt" if bug.runs_on == "torch-gpt" else "megatron-gpt"
            for precision in precisions:
                if (pinned and precision != pinned) or (workload == "torch-gpt" and precision not in TORCH_GPT_PRECISIONS):
                    continue
                runs.append(Run(workload=workload, precision=precision, variant=variant, layout=layout, bug=bug.name,
                                split=split))
    return runs


def clean_runs(precisions: list[str], split: str = "in-sample") -> list[Run]:
    runs = [Run(workload="megatron-gpt", precision=p, variant=v, layout=layout, split=split)
            for p in precisions for v, layout in CLEAN_LAYOUTS]
    runs += [Run(workload="torch-gpt", precision=p, variant="base", layout="--cp 2", split=split)
             for p in precisions if p in TORCH_GPT_PRECISIONS]
    return runs


def record(run: Run, work: Path, loss_steps: int, log: Path) -> str:
    """Record a run unless a complete one is there; returns "" or why it failed."""
    out = run.directory(work)
    if (out / "manifest.json").exists() and list(out.glob("rank_*.h5")) and not list(out.glob("*.partial")):
        return ""
    subprocess.run(["rm", "-rf", str(out)], check=True)
    command = ["ttrace", "example", run.workload, *run.flags(loss_steps), "--out", str(out)]
    with log.open("a") as handle:
        handle.write(f"\n$ {shlex.join(command)}\n")
        handle.flush()
        done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT)
    return "" if done.returncode == 0 else f"recording failed (exit {done.returncode}, see {log})"


def estimate(reference: Path, samples: int, log: Path, *, for_precision: str | None = None) -> None:
    """`ttrace estimate` unless done; `for_precision` "fp8" re-runs a bf16 reference in fp8 (fp8 vs bf16 rows)."""
    extra = [] if for_precision is None else ["--for-precision", for_precision]
    if estimate_path(reference, for_precision).exists():
        return
    with log.open("a") as handle:
        subprocess.run(["ttrace", "estimate", str(reference), "--samples", str(samples), "--keep-samples", *extra], stdout=handle,
                       stderr=subprocess.STDOUT, check=True)


def losses(run_dir: Path) -> list[float] | None:
    path = run_dir / "losses.json"
    return json.loads(path.read_text())["losses"] if path.exists() else None


def perturbation_tolerances(reference: RunReader, candidate: RunReader):
    """What `ttrace compare --tolerance perturbation` judges with: the estimate, the step scalars' own in front."""
    return with_step_scalars(select_tolerances("perturbation", reference, candidate), reference, candidate)


def evaluate(run: Run, work: Path, spread: float | None) -> Row:
    reference_run, oracle_run = run.reference(), run.reference("fp64")
    truth = ZOO[run.bug].first_divergence if run.bug else ""
    with RunReader(reference_run.directory(work)) as reference, RunReader(run.directory(work)) as candidate, \
            RunReader(oracle_run.directory(work)) as oracle:
        result = compare_runs(reference, candidate, perturbation_tolerances(reference, candidate))
        num_layers = num_layers_of(reference)
        theorem = compare_from_errors(result, select_tolerances("theorem", reference, candidate))
        l0 = baselines.megatron_l0_first_failure(result, num_layers, run.precision)
        elementwise = baselines.elementwise_first_failures(reference, candidate, oracle, result)
    ref_losses, cand_losses = losses(reference_run.directory(work)), losses(run.directory(work))
    loss_step = "n/a"
    if ref_losses and cand_losses and spread is not None:
        step = baselines.loss_curve_step(ref_losses, cand_losses, spread)
        loss_step = f"not within {len(ref_losses)}" if step is None else str(step)
    rewrite, first_tensor = localization_columns(run, work, reference_run, result)
    row = Row(localized_rewrite=rewrite, localized_first_tensor=first_tensor, precision=run.precision, run=run.bug or "clean",
              variant=run.variant, layout=run.layout, detected=None, first_divergence="", first_ratio=None, max_ratio=None,
              ground_truth=truth, theorem=theorem, megatron_l0=l0 is not None,
              assert_close=elementwise["assert_close"] is not None, dynamo=elementwise["dynamo"] is not None,
              loss_step=loss_step)
    fill_verdict(row, result)
    return row


def localization_columns(run: Run, work: Path, reference_run: Run, result) -> tuple[str, str]:
    """("yes"/"no: <named>", "yes"/"no") for a bug run; "-" for clean runs and undetected bugs."""
    if run.bug is None or result.passed:
        return "-", "-"
    first = result.first_divergence
    first_tensor = "yes" if first_tensor_points_at(run.bug, first.key.phase, first.key.fqn) else "no"
    found = localize(reference_run.directory(work), run.directory(work), original=result, reuse_replay=True)
    named = found.culprits[0] if found.culprits else "nothing"
    return ("yes" if localized_correctly(run.bug, found) else f"no: {named}"), first_tensor


def evaluate_ttrace_only(run: Run, work: Path, *, reference_precision: str | None = None) -> Row:
    """ttrace's verdict columns only (held-out split: no baselines, no localization replays).
    `reference_precision` "bf16" judges an fp8 run against the bf16 reference (`--for-precision fp8` estimate)."""
    reference_run = run.reference(reference_precision)
    label = run.precision if reference_precision is None else f"{run.precision} vs {reference_precision}"
    try:
        with RunReader(reference_run.directory(work)) as reference, RunReader(run.directory(work)) as candidate:
            result = compare_runs(reference, candidate, perturbation_tolerances(reference, candidate))
    except Exception as error:  # one broken run must not lose the table
        return failed_row(run, f"evaluation failed: {type(error).__name__}: {error}".replace("|", "/")[:200], label)
    row = Row(split=run.split, precision=label, run=run.bug or "clean", variant=run.variant, layout=run.layout, detected=not result.passed,
              first_divergence="", first_ratio=None, max_ratio=None, ground_truth=ZOO[run.bug].first_divergence if run.bug else "",
              theorem=None, megatron_l0=None, assert_close=None, dynamo=None, loss_step="n/a")
    fill_verdict(row, result)
    print(f"{run.split} {label} {row.run} {row.layout}: detected {row.detected} first {_fmt(row.first_ratio)} "
          f"max {_fmt(row.max_ratio)}", flush=True)
    return row


STRUCTURE_COLUMNS = {"scale": ("scale",), "offset": ("offset",), "bias": ("bias",), "shard": ("shard",),
                     "update": ("update", "replica update")}
"""Each structure column of the results (max_<column>, decided by) and the tests it gathers."""


def fill_verdict(row: Row, result) -> None:
    """ttrace's columns of `row` from a comparison: verdict, first divergence and its numbers, largest ratio."""
    first = result.first_divergence
    row.detected, row.first_divergence = not result.passed, str(first.key) if first is not None else ""
    row.first_ratio = first.ratio if first is not None else None
    row.first_error = first.error if first is not None else None
    row.first_tolerance = first.tolerance.rel if first is not None and first.tolerance else None
    row.first_method = first.tolerance.method if first is not None and first.tolerance else ""
    row.max_ratio = max((c.ratio for c in result.comparisons if c.ratio is not None), default=None)
    row.first_decided_by = first.decided_by if first is not None else ""
    row.first_finding = next((t.finding for t in (first.structure if first is not None else []) if t.name == first.decided_by), "")
    row.max_norm = max((max(c.value_ratio or 0.0, c.drift_ratio or 0.0) for c in result.comparisons
                        if c.value_ratio is not None or c.drift_ratio is not None), default=None)
    for column, names in STRUCTURE_COLUMNS.items():
        setattr(row, f"max_{column}", max((t.ratio for c in result.comparisons for t in c.structure if t.name in names),
                                          default=None))


def compare_from_errors(result, tolerances) -> bool:
    """Would a norm-based tolerance (abs 0) flag the run, from the relative errors already computed?"""
    for c in result.comparisons:
        if c.error is None:
            if c.status in ("missing", "extra", "shape", "dtype", "layout"):
                return True
            continue
        tolerance = tolerances.tolerance_for(c.key, c.dtype or "float32")
        if c.error > tolerance.rel or c.status == "nonfinite":
            return True
    return False


def failed_row(run: Run, note: str, label: str | None = None) -> Row:
    return Row(precision=label or run.precision, run=run.bug or "clean", variant=run.variant, layout=run.layout, detected=None,
               first_divergence="", first_ratio=None, max_ratio=None, ground_truth=ZOO[run.bug].first_divergence if run.bug else "",
               theorem=None, megatron_l0=None, assert_close=None, dynamo=None, loss_step="n/a", note=note)


def prepare_references(runs: list[Run], work: Path, args: argparse.Namespace, log: Path, *, oracle: bool = True) -> None:
    """Record (and estimate) every reference the runs need; the fp64 oracle too when the baselines run, and
    with --crossed only the bf16 reference of the fp8 runs, estimated for fp8."""
    needed = {(r.workload, r.precision, r.variant, r.split) for r in runs}
    oracles = {(w, "fp64", v, s) for w, _, v, s in needed} if oracle else set()
    crossed = getattr(args, "crossed", False)
    if crossed:
        needed |= {(w, "bf16", v, s) for w, p, v, s in needed if p == "fp8"}
    for workload, precision, variant, split in sorted(needed | oracles):
        reference = Run(workload=workload, precision=precision, variant=variant, layout="", split=split)
        failure = record(reference, work, args.loss_steps, log)
        if failure:
            raise SystemExit(f"{reference.directory(work)}: {failure}")
        if not getattr(args, "skip_estimates", False):
            if precision != "fp64" and not crossed:
                estimate(reference.directory(work), args.samples, log)
            if precision == "bf16" and (workload, "fp8", variant, split) in needed:
                estimate(reference.directory(work), args.samples, log, for_precision="fp8")
        print(f"reference ready: {workload} {precision} {variant}", flush=True)


def record_all(runs: list[Run], args: argparse.Namespace, log: Path, *, oracle: bool) -> None:
    prepare_references(runs, args.work, args, log, oracle=oracle)
    for index, run in enumerate(runs, start=1):
        print(f"[{index}/{len(runs)}] {run.split} {run.precision} {run.variant} {run.name} "
              f"{record(run, args.work, args.loss_steps, log) or 'recorded'}", flush=True)


def spreads(cleans: list[Run], work: Path) -> dict[tuple, float]:
    """Per (workload, precision, variant): the largest clean-vs-reference loss difference."""
    result = {}
    for key in {(r.workload, r.precision, r.variant) for r in cleans}:
        reference = losses(Run(workload=key[0], precision=key[1], variant=key[2], layout="", split="in-sample").directory(work))
        curves = [losses(r.directory(work)) for r in cleans if (r.workload, r.precision, r.variant) == key]
        if reference and all(curves):
            result[key] = baselines.clean_spread(reference, curves)
    return result


def summary(rows: list[Row], *, ttrace_only: bool = False) -> list[str]:
    """Summary lines; every figure names its denominator. `ttrace_only`: no baseline, loss or localization lines."""
    lines = []
    bugs = [r for r in rows if r.run != "clean" and r.detected is not None]
    cleans = [r for r in rows if r.run == "clean" and r.detected is not None]
    for precision in sorted({r.precision for r in rows}):
        b = [r for r in bugs if r.precision == precision]
        c = [r for r in cleans if r.precision == precision]
        weakest = min((r for r in b if r.detected and r.first_ratio is not None), key=lambda r: r.first_ratio, default=None)
        clean_max = max((r.max_ratio for r in c if r.max_ratio is not None), default=None)
        line = (f"- {precision}: ttrace detects {sum(bool(r.detected) for r in b)}/{len(b)} bug runs, "
                f"{sum(bool(r.detected) for r in c)}/{len(c)} false alarms on clean runs")
        if weakest is not None:
            line += (f"; smallest ratio at a bug's first divergence {weakest.first_ratio:.3g} ({weakest.run}, "
                     f"{weakest.layout}); {sum(r.first_ratio is not None and r.first_ratio >= 3 for r in b)}/{len(b)} "
                     f"bug runs at >= 3")
        if clean_max is not None:
            line += f"; largest clean ratio {clean_max:.3g} ({sum(r.max_ratio is not None and r.max_ratio <= 0.5 for r in c)}/{len(c)} clean runs <= 0.5)"
        if weakest is not None and clean_max:
            line += f"; separation (smallest bug ratio / largest clean ratio) {weakest.first_ratio / clean_max:.3g}"
        lines.append(line)
    if ttrace_only:
        return lines + _failed_lines(rows)
    for name in ("theorem", "megatron_l0", "assert_close", "dynamo"):
        judged_bugs = [r for r in bugs if getattr(r, name) is not None]
        judged_cleans = [r for r in cleans if getattr(r, name) is not None]
        lines.append(f"- {name}: misses {sum(getattr(r, name) is False for r in judged_bugs)}/{len(judged_bugs)} bug runs, "
                     f"false alarms on {sum(bool(getattr(r, name)) for r in judged_cleans)}/{len(judged_cleans)} clean runs")
    detected = [r for r in bugs if r.detected and r.localized_rewrite != "-"]  # (rows with ttrace's columns only: none)
    lines.append(f"- localization, rewrite replay (`ttrace localize`): names the ground truth first in "
                 f"{sum(r.localized_rewrite == 'yes' for r in detected)}/{len(detected)} detected bug runs; "
                 f"blaming the first failing tensor: {sum(r.localized_first_tensor == 'yes' for r in detected)}/{len(detected)}")
    with_curve = [r for r in bugs if r.loss_step != "n/a"]
    bugs = [r for r in bugs if " vs " not in r.precision]  # (crossed rows record no loss curve of their own)
    lines.append(f"- loss curve: {sum(r.loss_step.startswith('not') for r in with_curve)}/{len(with_curve)} bug runs with a "
                 f"loss curve never leave the clean spread within the steps run ({len(bugs) - len(with_curve)} torch-gpt "
                 "runs record no loss curve)")
    return lines + _failed_lines(rows)


def _failed_lines(rows: list[Row]) -> list[str]:
    failed = [r for r in rows if r.note]
    if not failed:
        return []
    return [f"- {len(failed)} runs could not be evaluated: " + "; ".join(f"{r.run} {r.layout} {r.precision}: {r.note}" for r in failed)]


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


DESCRIPTION = (
    "megatron-gpt: 4 layers, hidden 64, 4 micro-batches of 2 x 16 tokens, seed 0; torch-gpt for cp-attn-backward. "
    "ttrace: perturbation tolerances (alpha 4, floor 1 eps), tightened to 4 sqrt(n) eps where everything a tensor is "
    "computed from was bitwise exact (docs/tolerances.md). Ratios are error / tolerance (<= 1 passes); `first_ratio` is at "
    "the first divergent tensor, `max_ratio` the largest over the run. Baselines: `theorem` k=4 C=1.03 per-tensor depth; "
    "`megatron_l0` Megatron's check at l=0 on reduced gradients; `assert_close` torch defaults per dtype; `dynamo` "
    "torch._dynamo.utils.same with an fp64 oracle; `loss_step` the first step whose loss leaves the clean-vs-reference "
    "spread (n/a: torch-gpt records no loss curve). `localized_rewrite`: `ttrace localize` (rewrite replay) names the "
    "ground-truth culprit first; `localized_first_tensor`: the first failing tensor lies in it.")


def provenance(args: argparse.Namespace, seconds: float) -> str:
    """How the in-sample rows were produced: the command line and its duration."""
    only = f" --only {args.only}" if args.only else ""
    return (f"`python benchmarks/detection.py --precisions {','.join(args.precisions)} --samples {args.samples} "
            f"--loss-steps {args.loss_steps}{' --rescore' if args.rescore else ''}{only}` ({seconds / 60:.0f} min on "
            f"{_cpu_count()} cores"
            f"{'; rows of variant(s) ' + ','.join(args.variants) + ' re-run and merged' if args.merge and args.variants else ''}"
            f"{'; ttrace columns recomputed on fresh traces, the baseline columns kept' if args.rescore else ''}).")


def write_results(rows: list[Row], made_by: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    with (RESULTS / "detection.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    columns = ["precision", "run", "variant", "layout", "detected", "first_divergence", "first_ratio", "max_ratio",
               "localized_rewrite", "localized_first_tensor", "theorem", "megatron_l0", "assert_close", "dynamo",
               "loss_step", "note"]
    table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    table += ["| " + " | ".join(_fmt(getattr(r, c)) for c in columns) + " |" for r in rows]
    header = ["# Detection benchmark", "", f"{made_by} {DESCRIPTION}", "", "## Summary", "", *summary(rows), "",
              "## Runs", "", *table, ""]
    (RESULTS / "detection.md").write_text("\n".join(header + held_out_sections()))


HELD_OUT_CSV = RESULTS / "detection_heldout.csv"
HELD_OUT_MARKER = "## Held-out split"
# Why a bug stays below ratio 3 where it does, and what a user can do (numbers in the generated rows).
BELOW_THREE = {
    "expert-grad-scale": "the expert weights' gradient is off by 2x (relative error 0.5), but MoE experts are not traced, so "
                         "the exact-inputs rule cannot reach it and the tolerance is the estimate's: an e5m2 gradient "
                         "requantized after a bf16-sized perturbation moves by the amount in the tolerance column. "
                         "What to do: record with more micro-batches per step (the expert's gradient then averages more "
                         "tokens and its requantization noise shrinks), or compare in bf16 first: the same bug is at 12 there.",
    "distopt-stale-params": "in-sample rows only, judged before the update tests existed: the post-step parameters of "
                            "one DP rank's shard are not refreshed, one Adam update (1.5% of weights of about 1), two bf16 "
                            "ulps of the value, under the norm's tolerance and the replica drift's floor of one eps. The "
                            "held-out rows are decided by `replica update` (the replicas' difference is 100% of the "
                            "update, against a rounding model of 0.45%: ratio 55 to 223).",
    "attn-dq-wrong": "in fp8 the attention backward's inputs are not bitwise exact (under TP2 the requantized grad_output "
                     "of linear_proj; against bf16 every fp8 GEMM), so the rule cannot hold it to k sqrt(n) eps and the "
                     "estimate's e5m2 noise decides. "
                     "What to do: check the same layout in bf16 (ratio 14), where requantization does not amplify round-off.",
    "swiglu-tp-shard": "the wrong half of [gate; up] is a module input produced by glue, which the exact-inputs rule does not "
                       "cover (glue-made inputs are not checked yet); in fp8 the estimate for it includes e4m3 "
                       "requantization of fc1's output, and against bf16 all of fp8's quantization. What to do: "
                       "check the layout in bf16 (ratio 8.8) or fp32.",
    "row-parallel-bias-per-rank": "the bias added on both TP ranks is 2 x the module's own bias along the output, which "
                                  "the bias test reads against the estimate's draws of the same statistic; a bias small "
                                  "next to the output leaves the norm and offset tests near 0.5. What to do: judge fp8 "
                                  "against an fp8 reference (the exact-inputs rule then applies: ratio 75 held-out).",
    "sp-gather-wrong-dim": "fp8 only: the first divergence is output_layer's weight gradient, a reduced gradient whose e5m2 "
                          "requantization noise the estimate puts at 40%; the activation gradients the bug corrupts first "
                          "show later in execution order. What to do: check in bf16 (ratio 16).",
    "dp-grad-avg-twice": "fp8 against bf16 only: the gradient is halved (error 0.49), but an fp8 bias gradient differs from "
                         "the bf16 one by up to 48% through e5m2 quantization alone, so only a tolerance that knows the "
                         "fp8 run (an fp8 reference) separates them. What to do: judge fp8 against an fp8 reference (ratio 5.7).",
}


NOT_DETECTED = {
    "row-parallel-bias-per-rank": "",
    "fp8-amax-wrong-group": "Against a bf16 reference the scales have no counterpart: only the fp8 candidate's own replicas "
                            "of each scale are checked against each other (docs/tolerances.md, quantization scales), which "
                            "a wrong group that still gives every TP rank the same amax passes. Against an fp8 reference "
                            "the scales are compared with values too.",
}
LOUD_CLEAN = {
    ("fp8", "swiglu"): "At an fp8 inverse scale of step 1 (held-out: `decoder.layers.5.mlp.linear_fc2.fp8_scale_inv / "
                       "input.0`, a single number, the amax of fc2's input, off by 41% against a 48% tolerance). A scale "
                       "is one heavy-tailed number; four perturbed re-runs pooled over the micro-batches give eight "
                       "draws of it. Not yet fixed: a scale's tolerance should follow the amax of the tensor it scales "
                       "(the recorded input's largest element, in both runs), not eight draws.",
    ("fp8 vs bf16", "base"): "In-sample only, at step 1's embedding gradients (`step 1 / mb 0 / backward / "
                             "embedding.embedding_dropout / grad_input.0` and the word and position embeddings' "
                             "grad_output): the fp8 run's gradient is 4.8% smaller along the bf16 one (scale -0.048) "
                             "against a scale tolerance of 0.085, alpha 4 x the largest scale among the estimate's "
                             "draws (about 0.021). Within the verdict, above the 0.5 goal, and not explained yet: why "
                             "the TP2 candidates' step-1 embedding gradient shrinks twice as much as any fp8 re-run of "
                             "the reference. The held-out runs stay <= 0.5 there.",
    ("fp8 vs bf16", "moe"): "At step 1's expert weight gradients (`decoder.layers.6.mlp.experts.local_experts.0."
                            "linear_fc2.weight / grad` held-out): the router sends tokens to other experts once fp8 and "
                            "bf16 weights have drifted apart by a step, so an expert's gradient moves by 78% against 4 "
                            "draws of 0.25 to 0.36; r_t now takes the tail of the same expert's draws in every layer "
                            "(up to 2.2x the median), which held the held-out run at 0.30.",
}


def write_held_out(rows: list[Row], seconds: float) -> None:
    """Rows of this invocation's split replace that split's rows in detection_heldout.csv; the others stay."""
    RESULTS.mkdir(exist_ok=True)
    splits = {r.split for r in rows}
    kept = [r for r in _read_rows(HELD_OUT_CSV) if (r.split or "held-out") not in splits] if HELD_OUT_CSV.exists() else []
    rows = kept + rows
    with HELD_OUT_CSV.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    text = (RESULTS / "detection.md").read_text()
    head = text.split(HELD_OUT_MARKER)[0].rstrip() + "\n\n"
    (RESULTS / "detection.md").write_text(head + "\n".join(held_out_sections(seconds)))


def _read_rows(path: Path) -> list[Row]:
    with path.open() as handle:
        return [_row_from_csv(r) for r in csv.DictReader(handle)]


def held_out_sections(seconds: float | None = None) -> list[str]:
    """detection.md's held-out part: in-sample and held-out figures side by side, fp8 vs bf16, the bugs below 3."""
    if not HELD_OUT_CSV.exists():
        return []
    held, inside = _read_rows(HELD_OUT_CSV), _read_rows(RESULTS / "detection.csv")
    crossed = [r for r in held if " vs " in r.precision]
    held = [r for r in held if " vs " not in r.precision]
    timing = f" ({seconds / 60:.0f} min on {_cpu_count()} cores)" if seconds else ""
    lines = [
        HELD_OUT_MARKER, "",
        "ttrace's settings were chosen on the in-sample split, the runs above: alpha 4 is the smallest of 2, 3, 4, 6, 8 "
        "that keeps every clean in-sample run at or below 0.5 (largest clean ratio 0.434 at alpha 4, 0.58 at alpha 3); "
        "the floor (1 eps) and the exact-inputs k (4, the theorem's default) come from the analysis, not from data. No "
        "setting was fitted to a bug, so each bug class is left out of the calibration by construction: the "
        "leave-one-bug-class-out figures are the per-class rows below.", "",
        f"The held-out split changes everything the settings could have been fitted to: {SPLITS['held-out'].describe()} "
        f"instead of {SPLITS['in-sample'].describe()}. `python benchmarks/detection.py --split held-out --loss-steps 2`"
        f"{timing}: ttrace's own columns (no baselines, no localization replays).", "",
        "### Summary, in-sample | held-out", "",
        "| precision | bug runs detected | false alarms | smallest first-divergence ratio | bug runs >= 3 | largest clean ratio | clean runs <= 0.5 |",
        "|---|---|---|---|---|---|---|",
    ]
    for precision in sorted({r.precision for r in held}) + sorted({r.precision for r in crossed}):
        cells = [_precision_figures([r for r in rows if r.precision == precision]) for rows in (inside, held + crossed)]
        lines.append(f"| {precision} | " + " | ".join(f"{a} \\| {b}" for a, b in zip(*cells)) + " |")
    # The three precisions judged against a reference of their own, together (the baselines' denominators).
    own = sorted({r.precision for r in held})
    cells = [_precision_figures([r for r in rows if r.precision in own]) for rows in (inside, held)]
    lines.append(f"| {', '.join(own)} together | " + " | ".join(f"{a} \\| {b}" for a, b in zip(*cells)) + " |")
    cleans = [r for r in held + crossed if r.run == "clean" and r.detected is not None]
    lines += ["", f"Held-out clean runs: {len(cleans)}, {sum((r.split or 'held-out') == 'held-out' for r in cleans)} at the "
              f"held-out size and {sum(r.split == 'held-out-2' for r in cleans)} at a second size and seed "
              f"({SPLITS['held-out-2'].describe()}; `--split held-out-2`, clean runs only).", ""]
    lines += structure_section(held + crossed)
    second = [r for r in held if (r.split or "held-out") != "held-out"]
    held = [r for r in held if (r.split or "held-out") == "held-out"]
    lines += ["", "### By bug class (leave-one-bug-class-out): smallest first-divergence ratio, in-sample | held-out", "",
              "| bug class | " + " | ".join(sorted({r.precision for r in held})) + " |", "|---|" + "---|" * len({r.precision for r in held})]
    for bug_class in sorted({ZOO[r.run].bug_class for r in held if r.run != "clean"}):
        cells = []
        for precision in sorted({r.precision for r in held}):
            pair = [_smallest_first([r for r in rows if r.precision == precision and r.run != "clean"
                                     and ZOO[r.run].bug_class == bug_class]) for rows in (inside, held)]
            cells.append(f"{pair[0]} \\| {pair[1]}")
        lines.append(f"| {bug_class} | " + " | ".join(cells) + " |")
    lines += ["", "### Every run, in-sample | held-out", "",
              "| precision | run | variant | layout | first ratio | max ratio | held-out first divergence | held-out error / tolerance (method) |",
              "|---|---|---|---|---|---|---|---|"]
    by_key = {(r.precision, r.run, r.variant, r.layout): r for r in inside}
    for r in held:
        old = by_key.get((r.precision, r.run, r.variant, r.layout))
        lines.append(f"| {r.precision} | {r.run} | {r.variant} | {r.layout} | {_fmt(old.first_ratio if old else None)} \\| "
                     f"{_fmt(r.first_ratio)} | {_fmt(old.max_ratio if old else None)} \\| {_fmt(r.max_ratio)} | "
                     f"{r.first_divergence or '-'} | {_error_over_tolerance(r)} |")
    if crossed:
        lines += ["", "### FP8 candidates against the bf16 reference (held-out split)", "",
                  "The bf16 single-rank reference re-run in fp8 with perturbed weights (`ttrace estimate REF --for-precision "
                  "fp8`): each tolerance holds the fp8 quantization plus round-off; the exact-inputs rule is off (exact "
                  "inputs still quantize differently) and the fp8 scale tensors, which the bf16 run lacks, are noted, "
                  "not compared.", "", *summary(crossed, ttrace_only=True), "",
                  "| run | variant | layout | detected | first ratio | max ratio | first divergence | error / tolerance |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r.run} | {r.variant} | {r.layout} | {_fmt(r.detected)} | {_fmt(r.first_ratio)} | {_fmt(r.max_ratio)} | "
                  f"{r.first_divergence or '-'} | {_error_over_tolerance(r)} |" for r in crossed]
    lines += ["", "### Bug runs below ratio 3, and why", ""]
    # A run detected without a ratio at its first divergence (a missing tensor decided) is under 3 too.
    thin = [(split, r) for split, rows in (("in-sample", inside), ("held-out", held), ("held-out", crossed))
            for r in rows if r.run != "clean" and r.detected and (r.first_ratio is None or r.first_ratio < 3)]
    for split, r in thin:
        at = f"at `{r.first_divergence}`" if r.first_divergence else "with no tensor over its tolerance (a missing one decided)"
        lines.append(f"- {split}, {r.precision} {r.run} ({r.layout}): ratio {_fmt(r.first_ratio)} {at}, "
                     f"{_error_over_tolerance(r)}. {BELOW_THREE.get(r.run, '')}")
    missed = [(split, r) for split, rows in (("in-sample", inside), ("held-out", held), ("held-out", crossed)) for r in rows
              if r.run != "clean" and r.detected is False]
    loud = [(split, r) for split, rows in (("in-sample", inside), ("held-out", held), ("held-out", crossed),
                                           ("held-out-2", second)) for r in rows
            if r.run == "clean" and r.max_ratio is not None and r.max_ratio > 0.5]
    if missed or loud:
        lines += ["", "### Missed bugs and clean runs above 0.5", ""]
    lines += [f"- {split}, {r.precision} {r.run} ({r.layout}): not detected. {NOT_DETECTED.get(r.run, '')}" for split, r in missed]
    lines += [f"- {r.split or split}, {r.precision} clean {r.variant} ({r.layout}): largest ratio {_fmt(r.max_ratio)}. "
              f"{LOUD_CLEAN.get((r.precision, r.variant), '')}" for split, r in loud]
    return lines + [""]


def structure_section(rows: list[Row]) -> list[str]:
    """Each test's largest ratio over the clean runs (how close round-off came to each line), and which test
    decided each bug run's first divergence."""
    lines = ["### Each test's largest ratio on the held-out clean runs, and what decided the bug runs", "",
             "Next to the norm test (`norm`, with replica drift), each tensor gets the structure tests of "
             "docs/tolerances.md: `scale` (the error's projection on the reference), `offset` (its part constant "
             "along the tokens), `bias` (that part along the module's own bias), `shard` (the worst of the candidate's "
             "shards against its own values) and `update` (a post-step parameter's "
             "change against the change's own noise, and its replicas' difference in units of that change, `replica "
             "update`). The norm column includes replica drift, and with it the fp8 candidates' own scales against a "
             "bf16 reference (their replicas must agree).", "",
             "| precision | clean runs | norm | scale | offset | bias | shard | update | bug runs decided by norm / scale / "
             "offset / bias / shard / update |",
             "|---|---|---|---|---|---|---|---|---|"]
    for precision in sorted({r.precision for r in rows}, key=lambda p: (" vs " in p, p)):
        cleans = [r for r in rows if r.precision == precision and r.run == "clean" and r.detected is not None]
        bugs = [r for r in rows if r.precision == precision and r.run != "clean" and r.detected]
        largest = [_fmt(max((getattr(r, f"max_{name}") for r in cleans if getattr(r, f"max_{name}") is not None), default=None))
                   for name in ("norm", *STRUCTURE_COLUMNS)]
        decided = " / ".join(str(sum(r.first_decided_by in names for r in bugs))
                             for names in (("mismatch", "replica drift"), *STRUCTURE_COLUMNS.values()))
        lines.append(f"| {precision} | {len(cleans)} | " + " | ".join(largest) + f" | {decided} |")
    return lines


def _precision_figures(rows: list[Row]) -> list[str]:
    bugs = [r for r in rows if r.run != "clean" and r.detected is not None]
    cleans = [r for r in rows if r.run == "clean" and r.detected is not None]
    clean_max = max((r.max_ratio for r in cleans if r.max_ratio is not None), default=None)
    return [f"{sum(bool(r.detected) for r in bugs)}/{len(bugs)}", f"{sum(bool(r.detected) for r in cleans)}/{len(cleans)}",
            _smallest_first(bugs), f"{sum(r.first_ratio is not None and r.first_ratio >= 3 for r in bugs)}/{len(bugs)}",
            _fmt(clean_max), f"{sum(r.max_ratio is not None and r.max_ratio <= 0.5 for r in cleans)}/{len(cleans)}"]


def _smallest_first(rows: list[Row]) -> str:
    ratios = [r.first_ratio for r in rows if r.detected and r.first_ratio is not None]
    missed = sum(r.detected is False for r in rows)
    return (_fmt(min(ratios)) if ratios else "-") + (f" ({missed} missed)" if missed else "")


def _error_over_tolerance(row: Row) -> str:
    if row.first_error is None:
        return "-"
    return f"{_fmt(row.first_error)} / {_fmt(row.first_tolerance)} ({row.first_method or '-'})"


def rescored_rows(runs: list[Run], work: Path) -> list[Row]:
    """The committed rows with ttrace's verdict columns recomputed on the recorded traces."""
    with (RESULTS / "detection.csv").open() as handle:
        rows = [_row_from_csv(r) for r in csv.DictReader(handle)]
    by_key = {(r.precision, r.bug or "clean", r.variant, r.layout): r for r in runs}
    for row in rows:
        run = by_key.get((row.precision, row.run, row.variant, row.layout))
        if run is None or row.detected is None:
            continue
        reference_run = run.reference()
        with RunReader(reference_run.directory(work)) as reference, RunReader(run.directory(work)) as candidate:
            result = compare_runs(reference, candidate, perturbation_tolerances(reference, candidate))
        row.localized_rewrite, row.localized_first_tensor = localization_columns(run, work, reference_run, result)
        fill_verdict(row, result)
        print(f"rescored {row.precision} {row.run} {row.layout}: first {_fmt(row.first_ratio)} max {_fmt(row.max_ratio)}", flush=True)
    return rows


def merged_rows(new_rows: list[Row]) -> list[Row]:
    """The rows of the committed results, with those re-run now replaced (same order)."""
    with (RESULTS / "detection.csv").open() as handle:
        old_rows = [_row_from_csv(r) for r in csv.DictReader(handle)]
    fresh = {(r.precision, r.run, r.variant, r.layout): r for r in new_rows}
    merged = [fresh.pop((r.precision, r.run, r.variant, r.layout), r) for r in old_rows]
    return merged + list(fresh.values())


def _row_from_csv(data: dict) -> Row:
    def value(name: str, text: str):
        if text == "":
            return None if name in ("detected", "theorem", "megatron_l0", "assert_close", "dynamo", *FLOAT_COLUMNS) else ""
        if text in ("True", "False"):
            return text == "True"
        return float(text) if name in FLOAT_COLUMNS else text
    return Row(**{name: value(name, text) for name, text in data.items()})


FLOAT_COLUMNS = ("first_ratio", "max_ratio", "first_error", "first_tolerance", "max_norm", "max_scale", "max_offset",
                 "max_update", "max_bias", "max_shard")


def _cpu_count() -> int:
    import os

    return os.cpu_count() or 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precisions", default="fp32,bf16,fp8", type=lambda s: s.split(","))
    parser.add_argument("--work", default="/tmp/ttrace-detection", type=Path)
    parser.add_argument("--samples", type=int, default=4, help="perturbed re-runs per reference estimate")
    parser.add_argument("--loss-steps", type=int, default=20, help="training steps of every run (loss-curve baseline)")
    parser.add_argument("--only", default=None, help="comma-separated bug names (and 'clean') to run")
    parser.add_argument("--variants", default=None, type=lambda s: s.split(","),
                        help="only these model variants (base, swiglu, tied, moe)")
    parser.add_argument("--rerecord", action="store_true", help="record the selected candidate runs again")
    parser.add_argument("--rescore", action="store_true",
                        help="recompute only ttrace's own columns (verdicts, localization) of the committed rows")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of results/detection.csv that this invocation does not re-run")
    parser.add_argument("--split", default="in-sample", choices=sorted(SPLITS),
                        help="in-sample: the model ttrace's settings were chosen on; held-out: a model, data and seed "
                             "they never saw (ttrace's columns only, no baselines)")
    parser.add_argument("--record-only", action="store_true", help="record references, estimates and runs, then stop")
    parser.add_argument("--skip-estimates", action="store_true", help="with --record-only: record, but do not estimate")
    parser.add_argument("--crossed", action="store_true",
                        help="only the fp8 runs against the bf16 reference (fp8 vs bf16 rows, ttrace's columns), merged "
                             "into the split's results")
    parser.add_argument("--render", default=None, metavar="PROVENANCE",
                        help="only rewrite detection.md from the CSVs, saying PROVENANCE of the in-sample rows")
    args = parser.parse_args()
    if args.render:
        write_results(_read_rows(RESULTS / "detection.csv"), args.render)
        return
    held_out = args.split != "in-sample"
    started = time.monotonic()
    args.work.mkdir(parents=True, exist_ok=True)
    log = args.work / "detection.log"
    cleans, bugs = clean_runs(args.precisions, args.split), bug_runs(args.precisions, args.split)
    if args.split in CLEAN_ONLY_SPLITS:
        bugs = []
    if args.only:
        wanted = set(args.only.split(","))
        cleans = cleans if "clean" in wanted else []
        bugs = [b for b in bugs if b.bug in wanted]
    if args.variants:
        cleans, bugs = ([r for r in runs if r.variant in args.variants] for runs in (cleans, bugs))
    if args.rerecord:
        for run in cleans + bugs:
            subprocess.run(["rm", "-rf", str(run.directory(args.work))], check=True)
    if args.crossed:
        cleans, bugs = ([r for r in runs if r.precision == "fp8"] for runs in (cleans, bugs))
    if args.rescore or held_out or args.record_only or args.crossed:
        record_all(cleans + bugs, args, log, oracle=not (args.rescore or held_out or args.crossed))
    if args.record_only:
        return
    if args.crossed and not held_out:
        rows = [evaluate_ttrace_only(run, args.work, reference_precision="bf16") for run in cleans + bugs]
        made_by = (RESULTS / "detection.md").read_text().split("\n")[2].removesuffix(" " + DESCRIPTION)
        write_results(merged_rows(rows), f"{made_by} fp8 vs bf16 rows: `--crossed` ({(time.monotonic() - started) / 60:.0f} "
                                         f"min, ttrace's columns only).")
        print("\n".join(summary(rows, ttrace_only=True)))
        return
    if held_out:
        rows = [evaluate_ttrace_only(run, args.work) for run in cleans + bugs]
        rows += [evaluate_ttrace_only(run, args.work, reference_precision="bf16")
                 for run in cleans + bugs if run.precision == "fp8" and "bf16" in args.precisions]
        write_held_out(rows, time.monotonic() - started)
        print("\n".join(summary(rows, ttrace_only=True)))
        return
    if args.rescore:
        rows = rescored_rows(cleans + bugs, args.work)
        write_results(rows, provenance(args, time.monotonic() - started))
        print("\n".join(summary(rows)))
        return
    prepare_references(cleans + bugs, args.work, args, log)
    failures = {}
    for index, run in enumerate(cleans + bugs, start=1):
        failures[run.name, run.precision, run.variant, run.workload] = record(run, args.work, args.loss_steps, log)
        print(f"[{index}/{len(cleans) + len(bugs)}] {run.precision} {run.variant} {run.name} "
              f"{failures[run.name, run.precision, run.variant, run.workload] or 'recorded'}", flush=True)
    clean_spreads = spreads([r for r in cleans if not failures[r.name, r.precision, r.variant, r.workload]], args.work)
    rows = []
    for run in cleans + bugs:
        failure = failures[run.name, run.precision, run.variant, run.workload]
        try:
            row = failed_row(run, failure) if failure else evaluate(run, args.work, clean_spreads.get((run.workload, run.precision, run.variant)))
        except Exception as error:  # one broken run must not lose the table
            row = failed_row(run, f"evaluation failed: {type(error).__name__}: {error}".replace("|", "/")[:200])
        rows.append(row)
        print(f"{row.precision} {row.run} {row.layout}: detected {row.detected} first ratio {_fmt(row.first_ratio)} "
              f"max {_fmt(row.max_ratio)} {row.note}", flush=True)
    if args.merge:
        rows = merged_rows(rows)
    write_results(rows, provenance(args, time.monotonic() - started))
    print("\n".join(summary(rows)))


if __name__ == "__main__":
    sys.exit(main())
