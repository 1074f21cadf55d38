"""`ttrace estimate`: re-run the reference with perturbed weights and measure how far round-off
alone moves each traced tensor.

A workflow: it relaunches recording (record.command.relaunch) and compares the re-runs' logical tensors
with the reference's (canonicalize.logical_value). Output: a `compare.estimate_file.PerturbationEstimate`,
which the caller stores with `write_estimate`.

The method (TTrace v2): a backward-stable floating-point run equals the exact computation on
inputs moved by about the unit round-off u, so the reference re-run with its weights perturbed
elementwise, w * (1 + delta) with delta ~ U[-u, u], moves each tensor t by as much as round-off
can. For N samples, deviation_t = max_n ||T_t^(n) - T_t||_F. Relaunching uses only the manifest
(entrypoint factory and config); the re-runs are written under `.estimate/` and removed after.

A weight the run computes with in a coarser format than its precision is perturbed at that format's
u (`coarser_weights`): torchtitan's grouped MoE experts cast their weights and tokens to bf16 in an
fp32 run, where a perturbation of fp32's u would almost never move a bf16 value, and the experts'
bf16 round-off (which two layouts do differently: TP sums each expert's halves after rounding them)
would be missing from every tolerance downstream. The reference shows it: every value its module
outputs lies on the coarser format's grid.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ttrace_core.canonicalize.logical_value import logical_value
from ttrace_core.compare.estimate_file import PerturbationEstimate, TensorDeviation
from ttrace_core.compare.module_bias import module_bias
from ttrace_core.compare.shard_errors import largest_block_error
from ttrace_core.compare.routed_rows import routed_apart
from ttrace_core.compare.structure import statistics
from ttrace_core.compare.tolerances import machine_epsilon
from ttrace_core.errors import TtraceError
from ttrace_core.format.reader import RunReader, pre_step_key, read_manifest
from ttrace_core.format.schema import TensorKey
from ttrace_core.record.command import relaunch


@dataclass(frozen=True, slots=True)
class SampleDeviation:
    """How far one perturbed re-run moved one tensor."""

    deviation: float
    """||perturbed - reference||_F."""
    reference_norm: float
    numel: int
    structure: dict[str, float]
    """compare/structure.py's statistics of (perturbed - reference) on the reference."""


def deviations(reference: RunReader, perturbed: RunReader,
               reshaped: set[TensorKey] | None = None) -> dict[TensorKey, SampleDeviation]:
    """Every tensor both runs hold in the same logical shape: its deviation and its structure statistics.
    A tensor whose rows the perturbation changed (a MoE expert that the perturbed router sent other
    tokens, record/token_rows.py, compare/routed_rows.py: more or fewer rows, or as many of other tokens)
    has no deviation to measure: it is added to `reshaped`."""
    result = {}
    for key in reference.index:
        if key not in perturbed.index or reference.index[key][0].stats_only:
            continue
        if reference.index[key][0].layout.global_shape != perturbed.index[key][0].layout.global_shape or \
                routed_apart(key, reference, perturbed):  # as many rows, but some of them other tokens
            if reshaped is not None:
                reshaped.add(key)
            continue
        diff, expected = _finite_difference(reference, perturbed, key)
        before_key = pre_step_key(reference, key)
        before = None
        if before_key is not None and before_key in perturbed.index:
            before = _finite_difference(reference, perturbed, before_key)
        structure = statistics(diff, expected, before, module_bias(reference, key))
        if (block := largest_block_error(diff, expected)) is not None:
            structure["shard"] = block
        result[key] = SampleDeviation(deviation=float(torch.linalg.vector_norm(diff)),
                                      reference_norm=float(torch.linalg.vector_norm(expected)), numel=expected.numel(),
                                      structure=structure)
    return result


def _finite_difference(reference: RunReader, perturbed: RunReader, key: TensorKey) -> tuple[torch.Tensor, torch.Tensor]:
    """(perturbed - reference, reference) in float64, zero where either is not finite."""
    expected, actual = logical_value(reference, key), logical_value(perturbed, key)
    finite = torch.isfinite(expected) & torch.isfinite(actual)
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(finite, actual - expected, zero), torch.where(finite, expected, zero)


COARSER_FORMATS = (torch.bfloat16, torch.float16)
"""Formats a module may compute in below the run's precision, coarsest first."""
MIN_ON_GRID = 64
"""Nonzero output values that must all lie on a format's grid before the module is taken to compute in it
(a float32 value lies on bfloat16's grid by chance with probability 2^-16: 64 of them never do)."""


def grid_unit_roundoff(values: list[torch.Tensor]) -> float | None:
    """The unit round-off of the coarsest format in COARSER_FORMATS on whose grid every finite value of `values`
    lies (at least MIN_ON_GRID of them nonzero), or None."""
    finite = [v[torch.isfinite(v)] for v in values]
    if sum(int(torch.count_nonzero(v)) for v in finite) < MIN_ON_GRID:
        return None
    for dtype in COARSER_FORMATS:
        if all(torch.equal(v.to(dtype).to(v.dtype), v) for v in finite):
            return torch.finfo(dtype).eps / 2
    return None


def coarser_weights(reference: RunReader, relative: float) -> dict[str, float]:
    """Weight -> the unit round-off of the format its module computes in, for every float32/float64 weight whose
    module's forward outputs (first step, first micro-batch; of each expert, `<module>.<e>`, for a module of
    routed experts) all lie on a coarser grid than `relative` (the run's unit round-off): the module computed
    with it in that format (module docstring). A gradient does not show it: accumulated over micro-batches in
    float32, it leaves the grid."""
    weights = {key.fqn for key, metas in reference.index.items()
               if key.phase == "param" and key.slot == "value" and metas[0].dtype in ("float32", "float64")}
    first = min((key.step for key in reference.index), default=0)
    outputs: dict[str, list[TensorKey]] = {}
    for key, metas in reference.index.items():
        if key.step == first and key.micro_batch == 0 and key.phase == "forward" and key.slot.startswith("output") \
                and not metas[0].stats_only and metas[0].dtype in ("float32", "float64"):
            module, _, last = key.fqn.rpartition(".")
            outputs.setdefault(module if last.isdigit() and module else key.fqn, []).append(key)
            if last.isdigit():
                outputs.setdefault(key.fqn, []).append(key)
    found: dict[str, float] = {}
    units: dict[str, float | None] = {}
    for weight in sorted(weights):
        module = weight.rpartition(".")[0]
        if module not in outputs:
            continue
        if module not in units:
            units[module] = grid_unit_roundoff([logical_value(reference, key) for key in outputs[module]])
        if (unit := units[module]) is not None and unit > relative:
            found[weight] = unit
    return found


def estimate_reference(run_dir: str | os.PathLike, *, num_samples: int = 4, relative: float | None = None,
                       timeout_s: float = 600.0, num_workers: int | None = None,
                       for_precision: str | None = None, keep_samples: bool = False) -> PerturbationEstimate:
    """Re-run the reference `num_samples` times with perturbed weights and measure every tensor's deviation.

    `for_precision` (e.g. "fp8" on a bf16 reference): the re-runs compute in that precision, so each
    deviation is the quantization plus the round-off, the tolerance an fp8 candidate needs when it
    is judged against the bf16 run (the triangle inequality again: candidate vs an fp8 reference, plus
    that fp8 reference vs this one, each about one such deviation).

    `keep_samples`: leave the re-runs under `.estimate/<precision>/` and reuse the complete ones found
    there, so that a changed statistic can be measured again without re-running (benchmarks)."""
    if num_samples < 1:
        raise TtraceError(f"--samples {num_samples}: need at least 1 perturbed re-run")
    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir)
    if manifest.correspondence:
        raise TtraceError(f"{run_dir}: a reference mapped through {manifest.correspondence.get('map')} from "
                          f"{manifest.correspondence.get('source')}; estimate that run (`ttrace estimate "
                          f"{manifest.correspondence.get('source')}`): the mapping translates its estimate")
    if not manifest.entrypoint.get("command") and not manifest.entrypoint.get("factory"):
        raise TtraceError(f"{run_dir}/manifest.json: no entrypoint recorded, so the reference cannot be re-run; "
                          "record it with `ttrace record -- COMMAND` (or `ttrace example`)")
    if manifest.tracer.get("stats_only"):
        raise TtraceError(f"{run_dir}: recorded with --stats-only, so it holds no values to measure deviations on; "
                          "record the reference again without --stats-only")
    for_precision = None if for_precision in (None, manifest.precision) else for_precision
    relative = relative if relative is not None else machine_epsilon(manifest.precision) / 2  # unit round-off
    work = run_dir / ".estimate"
    if keep_samples:
        work = work / (for_precision or manifest.precision)
    else:
        shutil.rmtree(work, ignore_errors=True)
    with RunReader(run_dir) as reference:
        coarser = coarser_weights(reference, relative) if for_precision is None else {}
    if coarser:
        print(f"ttrace: estimate: {len(coarser)} weights are computed in a coarser format than {manifest.precision} (their "
              f"modules' outputs lie on its grid, e.g. {min(coarser)}): perturbed by up to {max(coarser.values()):.3g} instead "
              f"of {relative:.3g}", file=sys.stderr)
    outs = [work / f"sample_{i}" for i in range(num_samples)]
    missing = [(i, out) for i, out in enumerate(outs) if not (keep_samples and _complete(out))]
    workers = num_workers or max(1, (os.cpu_count() or 1) // manifest.world_size)
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=min(workers, num_samples)) as pool:
        futures = [pool.submit(relaunch, run_dir, manifest, out.resolve(), timeout_s=timeout_s, precision=for_precision,
                               perturbation={"sample": i, "relative": relative, "coarser": coarser})
                   for i, out in missing]
        for future in futures:
            future.result()
    if for_precision is not None:
        _check_precision_honoured(run_dir, outs, for_precision)
    estimate = PerturbationEstimate(precision=for_precision or manifest.precision, num_samples=num_samples,
                                    relative=relative, reference_precision=manifest.precision)
    reshaped: set[TensorKey] = set()
    with RunReader(run_dir) as reference:
        for out in outs:
            with RunReader(out) as perturbed:
                _merge(estimate, deviations(reference, perturbed, reshaped))
        unmeasured = _from_siblings(estimate, reshaped, reference)
    if reshaped:
        print(f"ttrace: estimate: {len(reshaped)} tensors changed rows in a perturbed re-run (routed experts that "
              f"received other tokens, e.g. {min(reshaped)}); {len(reshaped) - len(unmeasured)} take their sibling "
              f"experts' relative deviation, {len(unmeasured)} keep the per-dtype tolerance", file=sys.stderr)
    estimate.seconds = time.monotonic() - started
    if not keep_samples:
        shutil.rmtree(work, ignore_errors=True)
    return estimate


def _complete(run_dir: Path) -> bool:
    return (run_dir / "manifest.json").is_file() and any(run_dir.glob("rank_*.h5")) and not any(run_dir.glob("*.partial"))


def _check_precision_honoured(run_dir: Path, outs: list[Path], precision: str) -> None:
    for out in outs:
        recorded = read_manifest(out).precision
        if recorded != precision:
            shutil.rmtree(run_dir / ".estimate", ignore_errors=True)
            raise TtraceError(f"{run_dir}: asked its command to re-run in {precision} but it recorded {recorded}; the "
                              "script must apply ttrace_core.requested_precision() to its config (the bundled examples do)")


def _from_siblings(estimate: PerturbationEstimate, reshaped: set[TensorKey], reference: RunReader) -> set[TensorKey]:
    """A tensor whose shape some perturbed re-run changed (a routed expert that was sent other tokens) has no
    deviation of its own in every re-run. Its sibling experts (keys that differ from it only in the expert
    index, the last numeric component of the name: `local_experts.2.linear_fc1` and `local_experts.5.linear_fc1`)
    compute the same way on the same kind of rows, so it takes the largest relative deviation measured on
    any of them (itself included) in any re-run where the shape held. With none measured it is left out,
    and the per-dtype table judges it. Returns the keys left out."""
    measured: dict[tuple, list[float]] = {}
    for key, entry in estimate.tensors.items():
        if (signature := _sibling_signature(key)) is not None:
            measured.setdefault(signature, []).extend(v for v in entry.per_sample if math.isfinite(v))
    for key in reshaped:
        estimate.tensors.pop(key, None)
    left_out = set()
    for key in reshaped:
        values = measured.get(_sibling_signature(key)) or []
        if not values:
            left_out.add(key)
            continue
        meta = reference.index[key][0]
        norm = float(torch.linalg.vector_norm(logical_value(reference, key)))
        relative = max(values)
        estimate.tensors[key] = TensorDeviation(key=key, deviation=relative * norm, reference_norm=norm,
                                                numel=math.prod(meta.layout.global_shape),
                                                per_sample=[relative] * estimate.num_samples)
    return left_out


def _sibling_signature(key: TensorKey) -> tuple | None:
    """The key with the last numeric component of its name made a wildcard; None when the name has none."""
    parts = key.fqn.split(".")
    index = next((i for i in range(len(parts) - 1, -1, -1) if parts[i].isdigit()), None)
    if index is None:
        return None
    pattern = ".".join(parts[:index] + ["*"] + parts[index + 1:])
    return (key.step, key.micro_batch, key.phase, pattern, key.slot, key.call)


def _merge(estimate: PerturbationEstimate, sample: dict[TensorKey, SampleDeviation]) -> None:
    for key, found in sample.items():
        norm = found.reference_norm
        entry = estimate.tensors.setdefault(key, TensorDeviation(key=key, deviation=0.0, reference_norm=norm, numel=found.numel))
        entry.deviation = max(entry.deviation, found.deviation)
        entry.per_sample.append(found.deviation / norm if norm > 0 else (0.0 if found.deviation == 0 else math.inf))
        for name, value in found.structure.items():
            if math.isfinite(value):
                entry.structure.setdefault(name, []).append(value)
