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
from ttrace_core.compare import compare_runs
from ttrace_core.examples.megatron_gpt.bugs import ZOO, first_tensor_points_at, localized_correctly
from ttrace_core.localize import localize
from ttrace_core.store import RunReader
from ttrace_core.tolerances import num_layers_of, select_tolerances

RESULTS = Path(__file__).parent / "results"
VARIANT_FLAGS = {"base": [], "swiglu": ["--swiglu"], "tied": ["--tie-embeddings"], "moe": ["--moe"]}
CLEAN_LAYOUTS = [("base", "--tp 2"), ("base", "--tp 2 --sp"), ("base", "--pp 2"), ("base", "--dp 2"),
                 ("base", "--dp 2 --dist-opt"), ("base", "--tp 2 --pp 2 --sp"), ("swiglu", "--tp 2"),
                 ("tied", "--pp 2"), ("moe", "--tp 2 --sp"), ("moe", "--dp 2 --ep 2")]
TORCH_GPT_PRECISIONS = ("fp32", "bf16")  # torch-gpt has no fp8 recipe


@dataclass(kw_only=True)
class Run:
    workload: str
    precision: str
    variant: str
    layout: str
    bug: str | None = None

    @property
    def name(self) -> str:
        slug = self.layout.replace("--", "").replace(" ", "") or "ref"
        return f"{self.bug or 'clean'}-{slug}"

    def directory(self, work: Path) -> Path:
        return work / self.workload / self.precision / self.variant / self.name

    def flags(self, loss_steps: int) -> list[str]:
        flags = [*shlex.split(self.layout), *VARIANT_FLAGS[self.variant], "--precision", self.precision]
        if self.bug:
            flags += ["--bug", self.bug]
        if self.workload == "megatron-gpt":
            return flags + ["--steps", str(loss_steps), "--record-steps", "2"]
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


def bug_runs(precisions: list[str]) -> list[Run]:
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
                runs.append(Run(workload=workload, precision=precision, variant=variant, layout=layout, bug=bug.name))
    return runs


def clean_runs(precisions: list[str]) -> list[Run]:
    runs = [Run(workload="megatron-gpt", precision=p, variant=v, layout=layout) for p in precisions for v, layout in CLEAN_LAYOUTS]
    runs += [Run(workload="torch-gpt", precision=p, variant="base", layout="--cp 2") for p in precisions if p in TORCH_GPT_PRECISIONS]
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


def estimate(reference: Path, samples: int, log: Path) -> None:
    if (reference / "tolerance_estimate.json").exists():
        return
    with log.open("a") as handle:
        subprocess.run(["ttrace", "estimate", str(reference), "--samples", str(samples)], stdout=handle,
                       stderr=subprocess.STDOUT, check=True)


def losses(run_dir: Path) -> list[float] | None:
    path = run_dir / "losses.json"
    return json.loads(path.read_text())["losses"] if path.exists() else None


def evaluate(run: Run, work: Path, spread: float | None) -> Row:
    reference_run = Run(workload=run.workload, precision=run.precision, variant=run.variant, layout="")
    oracle_run = Run(workload=run.workload, precision="fp64", variant=run.variant, layout="")
    truth = ZOO[run.bug].first_divergence if run.bug else ""
    with RunReader(reference_run.directory(work)) as reference, RunReader(run.directory(work)) as candidate, \
            RunReader(oracle_run.directory(work)) as oracle:
        result = compare_runs(reference, candidate, select_tolerances("perturbation", reference, candidate))
        first = result.first_divergence
        num_layers = num_layers_of(reference)
        theorem = compare_from_errors(result, select_tolerances("theorem", reference, candidate))
        l0 = baselines.megatron_l0_first_failure(result, num_layers, run.precision)
        elementwise = baselines.elementwise_first_failures(reference, candidate, oracle, result)
    ref_losses, cand_losses = losses(reference_run.directory(work)), losses(run.directory(work))
    loss_step = "n/a"
    if ref_losses and cand_losses and spread is not None:
        step = baselines.loss_curve_step(ref_losses, cand_losses, spread)
        loss_step = f"not within {len(ref_losses)}" if step is None else str(step)
    ratios = [c.ratio for c in result.comparisons if c.ratio is not None]
    rewrite, first_tensor = localization_columns(run, work, reference_run, result)
    return Row(localized_rewrite=rewrite, localized_first_tensor=first_tensor, precision=run.precision, run=run.bug or "clean", variant=run.variant, layout=run.layout,
               detected=not result.passed, first_divergence=str(first.key) if first is not None else "",
               first_ratio=first.ratio if first is not None else None, max_ratio=max(ratios, default=None), ground_truth=truth,
               theorem=theorem, megatron_l0=l0 is not None, assert_close=elementwise["assert_close"] is not None,
               dynamo=elementwise["dynamo"] is not None, loss_step=loss_step)


def localization_columns(run: Run, work: Path, reference_run: Run, result) -> tuple[str, str]:
    """("yes"/"no: <named>", "yes"/"no") for a bug run; "-" for clean runs and undetected bugs."""
    if run.bug is None or result.passed:
        return "-", "-"
    first = result.first_divergence
    first_tensor = "yes" if first_tensor_points_at(run.bug, first.key.phase, first.key.fqn) else "no"
    found = localize(reference_run.directory(work), run.directory(work), original=result, reuse_replay=True)
    named = found.culprits[0] if found.culprits else "nothing"
    return ("yes" if localized_correctly(run.bug, found) else f"no: {named}"), first_tensor


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


def failed_row(run: Run, note: str) -> Row:
    return Row(precision=run.precision, run=run.bug or "clean", variant=run.variant, layout=run.layout, detected=None,
               first_divergence="", first_ratio=None, max_ratio=None, ground_truth=ZOO[run.bug].first_divergence if run.bug else "",
               theorem=None, megatron_l0=None, assert_close=None, dynamo=None, loss_step="n/a", note=note)


def prepare_references(runs: list[Run], work: Path, args: argparse.Namespace, log: Path) -> None:
    needed = {(r.workload, r.precision, r.variant) for r in runs}
    for workload, precision, variant in sorted(needed | {(w, "fp64", v) for w, _, v in needed}):
        reference = Run(workload=workload, precision=precision, variant=variant, layout="")
        failure = record(reference, work, args.loss_steps, log)
        if failure:
            raise SystemExit(f"{reference.directory(work)}: {failure}")
        if precision != "fp64":
            estimate(reference.directory(work), args.samples, log)
        print(f"reference ready: {workload} {precision} {variant}", flush=True)


def spreads(cleans: list[Run], work: Path) -> dict[tuple, float]:
    """Per (workload, precision, variant): the largest clean-vs-reference loss difference."""
    result = {}
    for key in {(r.workload, r.precision, r.variant) for r in cleans}:
        reference = losses(Run(workload=key[0], precision=key[1], variant=key[2], layout="").directory(work))
        curves = [losses(r.directory(work)) for r in cleans if (r.workload, r.precision, r.variant) == key]
        if reference and all(curves):
            result[key] = baselines.clean_spread(reference, curves)
    return result


def summary(rows: list[Row]) -> list[str]:
    lines = []
    bugs = [r for r in rows if r.run != "clean"]
    cleans = [r for r in rows if r.run == "clean"]
    for precision in sorted({r.precision for r in rows}):
        b = [r for r in bugs if r.precision == precision]
        c = [r for r in cleans if r.precision == precision]
        lines.append(f"- {precision}: ttrace detects {sum(bool(r.detected) for r in b)}/{len(b)} bug runs, "
                     f"{sum(bool(r.detected) for r in c)}/{len(c)} false alarms on clean runs")
    first = [r.first_ratio for r in bugs if r.detected and r.first_ratio is not None]
    clean_max = max((r.max_ratio for r in cleans if r.max_ratio is not None), default=None)
    if first and clean_max:
        lines.append(f"- smallest ratio at a bug's first divergence: {min(first):.3g}; largest ratio over all clean runs: "
                     f"{clean_max:.3g}; separation {min(first) / clean_max:.3g}x (needs >= 3x)")
    for name in ("theorem", "megatron_l0", "assert_close", "dynamo"):
        missed = sum(getattr(r, name) is False for r in bugs)
        alarms = sum(bool(getattr(r, name)) for r in cleans)
        lines.append(f"- {name}: misses {missed}/{len(bugs)} bug runs, false alarms on {alarms}/{len(cleans)} clean runs")
    detected = [r for r in bugs if r.detected]
    lines.append(f"- localization, rewrite replay (`ttrace localize`): names the ground truth first in "
                 f"{sum(r.localized_rewrite == 'yes' for r in detected)}/{len(detected)} detected bug runs; "
                 f"blaming the first failing tensor: {sum(r.localized_first_tensor == 'yes' for r in detected)}/{len(detected)}")
    loss_missed = sum(r.loss_step.startswith("not") for r in bugs)
    lines.append(f"- loss curve: {loss_missed}/{len(bugs)} bug runs never leave the clean spread within the steps run")
    failed = [r for r in rows if r.note]
    if failed:
        lines.append(f"- {len(failed)} runs could not be evaluated: " + "; ".join(f"{r.run} {r.layout} {r.precision}: {r.note}" for r in failed))
    return lines


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def write_results(rows: list[Row], args: argparse.Namespace, seconds: float) -> None:
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
    header = [
        "# Detection benchmark", "",
        f"`python benchmarks/detection.py --precisions {','.join(args.precisions)} --samples {args.samples} "
        f"--loss-steps {args.loss_steps}{' --rescore' if args.rescore else ''}` ({seconds / 60:.0f} min on {_cpu_count()} cores"
        f"{'; rows of variant(s) ' + ','.join(args.variants) + ' re-run and merged' if args.merge and args.variants else ''}"
        f"{'; ttrace columns recomputed on the traces of the full run, localization replays recorded again' if args.rescore else ''}). "
        "megatron-gpt: 4 layers, "
        "hidden 64, 4 micro-batches of 2 x 16 tokens; torch-gpt for cp-attn-backward. ttrace: perturbation tolerances "
        "(alpha 4, floor 1 eps), tightened to 4 sqrt(n) eps where everything a tensor is computed from was bitwise exact "
        "(docs/tolerances.md). Ratios are error / tolerance (<= 1 passes); `first_ratio` is at the first divergent "
        "tensor, `max_ratio` the largest over the run. Baselines: `theorem` k=4 C=1.03 per-tensor depth; "
        "`megatron_l0` Megatron's check at l=0 on reduced gradients; `assert_close` torch defaults per dtype; "
        "`dynamo` torch._dynamo.utils.same with an fp64 oracle; `loss_step` the first step whose loss leaves the "
        "clean-vs-reference spread. `localized_rewrite`: `ttrace localize` (rewrite replay) names the ground-truth "
        "culprit first; `localized_first_tensor`: the first failing tensor lies in it.", "", "## Summary", "", *summary(rows), "", "## Runs", "", *table, ""]
    (RESULTS / "detection.md").write_text("\n".join(header))


def rescored_rows(runs: list[Run], work: Path) -> list[Row]:
    """The committed rows with ttrace's verdict columns recomputed on the recorded traces."""
    with (RESULTS / "detection.csv").open() as handle:
        rows = [_row_from_csv(r) for r in csv.DictReader(handle)]
    by_key = {(r.precision, r.bug or "clean", r.variant, r.layout): r for r in runs}
    for row in rows:
        run = by_key.get((row.precision, row.run, row.variant, row.layout))
        if run is None or row.detected is None:
            continue
        reference_run = Run(workload=run.workload, precision=run.precision, variant=run.variant, layout="")
        with RunReader(reference_run.directory(work)) as reference, RunReader(run.directory(work)) as candidate:
            result = compare_runs(reference, candidate, select_tolerances("perturbation", reference, candidate))
        first = result.first_divergence
        row.localized_rewrite, row.localized_first_tensor = localization_columns(run, work, reference_run, result)
        row.detected, row.first_divergence = not result.passed, str(first.key) if first is not None else ""
        row.first_ratio = first.ratio if first is not None else None
        row.max_ratio = max((c.ratio for c in result.comparisons if c.ratio is not None), default=None)
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
            return None if name in ("detected", "first_ratio", "max_ratio", "theorem", "megatron_l0", "assert_close", "dynamo") else ""
        if text in ("True", "False"):
            return text == "True"
        return float(text) if name in ("first_ratio", "max_ratio") else text
    return Row(**{name: value(name, text) for name, text in data.items()})


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
    args = parser.parse_args()
    started = time.monotonic()
    args.work.mkdir(parents=True, exist_ok=True)
    log = args.work / "detection.log"
    cleans, bugs = clean_runs(args.precisions), bug_runs(args.precisions)
    if args.only:
        wanted = set(args.only.split(","))
        cleans = cleans if "clean" in wanted else []
        bugs = [b for b in bugs if b.bug in wanted]
    if args.variants:
        cleans, bugs = ([r for r in runs if r.variant in args.variants] for runs in (cleans, bugs))
    if args.rerecord:
        for run in cleans + bugs:
            subprocess.run(["rm", "-rf", str(run.directory(args.work))], check=True)
    if args.rescore:
        rows = rescored_rows(cleans + bugs, args.work)
        write_results(rows, args, time.monotonic() - started)
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
    write_results(rows, args, time.monotonic() - started)
    print("\n".join(summary(rows)))


if __name__ == "__main__":
    sys.exit(main())
