"""A reference of another implementation, made comparable: `ttrace compare REF CAND --map NAME`.

Input: a recorded reference run, the name or path of a correspondence map (integrations/shipped_maps.py).
Output: the mapped reference's run directory, REF/.ttrace/mapped/<map name>/, rewritten in the candidate's
names and layouts by canonicalize/mapped_run.py, with the reference's perturbation estimate translated
through the same map (`ttrace estimate REF` measures the reference's own tensors; this gives each mapped
tensor the deviation of the tensors it is made of). Compare, localize and the dashboard then take that
directory as the reference. It is made again whenever the map, the reference's files or its estimate
change, and reused otherwise.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
from pathlib import Path

from ttrace_core.canonicalize import map_transforms as mt
from ttrace_core.canonicalize.correspondence import LoadedMap
from ttrace_core.canonicalize.mapped_run import MappedRun, MappedTensor, write_mapped_run
from ttrace_core.compare.estimate_file import (
    PerturbationEstimate, TensorDeviation, estimate_files, read_estimate, write_estimate,
)
from ttrace_core.errors import MapError, TtraceError
from ttrace_core.format.reader import MANIFEST_NAME, STEP_FILE, RunReader, read_manifest
from ttrace_core.integrations.shipped_maps import find_map

MAPPED_DIR = Path(".ttrace") / "mapped"


def _source_digest(run_dir: Path) -> str:
    """What the mapped run depends on in the reference: its manifest, its step files (name, size, mtime) and
    its estimates' bytes."""
    digest = hashlib.sha256((run_dir / MANIFEST_NAME).read_bytes())
    for entry in sorted(os.listdir(run_dir)):
        if STEP_FILE.match(entry):
            stat = (run_dir / entry).stat()
            digest.update(f"{entry}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    for precision, path in sorted(estimate_files(run_dir).items(), key=lambda item: str(item[0])):
        digest.update(f"{precision}:".encode() + path.read_bytes())
    return digest.hexdigest()


def _up_to_date(out: Path, loaded: LoadedMap, source_digest: str) -> bool:
    try:
        correspondence = read_manifest(out).correspondence
    except TtraceError:
        return False
    return correspondence.get("map_digest") == loaded.digest and correspondence.get("source_digest") == source_digest


def mapped_reference(reference_dir: str | os.PathLike, map_name: str | os.PathLike, *,
                     progress=None) -> Path:
    """The reference mapped through the map (made now, or reused when up to date): the directory to pass
    to compare and localize as the reference."""
    reference_dir = Path(reference_dir)
    manifest = read_manifest(reference_dir)
    if manifest.correspondence:
        raise MapError(f"{reference_dir}: already a reference mapped through {manifest.correspondence.get('map')}; "
                       "pass the run it was made from with --map, or this one without it")
    if manifest.world_size != 1:
        raise MapError(f"{reference_dir}: a reference of {manifest.world_size} ranks; a map relates a one-rank "
                       "reference of another implementation to the candidate (docs/porting.md)")
    loaded = find_map(map_name)
    out = reference_dir / MAPPED_DIR / loaded.name
    source_digest = _source_digest(reference_dir)
    if _up_to_date(out, loaded, source_digest):
        return out
    if progress:
        progress(f"mapping {reference_dir} through {loaded.name} into {out}")
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.parent.mkdir(parents=True, exist_ok=True)
    with RunReader(reference_dir) as reader:
        mapped = write_mapped_run(loaded, reader, staging, {"source_digest": source_digest})
    for precision in estimate_files(reference_dir):
        estimate = read_estimate(reference_dir, precision)
        if estimate is not None:
            write_estimate(staging, mapped_estimate(estimate, mapped))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(staging, out)
    return out


def _combination(tensor: MappedTensor) -> str:
    """How the sources' round-off combines: "one" source, "concat" (squares add) or "sum" (norms add, at most)."""
    if any(isinstance(op, mt.Sum) for op in tensor.ops):
        return "sum"
    return "concat" if len(tensor.sources) > 1 else "one"


def _keeps_structure(tensor: MappedTensor) -> bool:
    """Whether the sources' structure statistics hold for the mapped tensor: one source, rows and features
    kept (a permutation of the leading dims; the statistics average over every dim but the last)."""
    if len(tensor.sources) != 1:
        return False
    for op in tensor.ops:
        if isinstance(op, mt.Permute):
            if op.dims[-1] % len(op.dims) != len(op.dims) - 1:
                return False
        elif not isinstance(op, mt.Scale):
            return False
    return True


def _absolute_deviations(deviation: TensorDeviation) -> list[float]:
    """||perturbed - reference||_F of each sample (the max for every sample of an estimate without them)."""
    if not deviation.per_sample:
        return [deviation.deviation]
    return [r * deviation.reference_norm if math.isfinite(r) else deviation.deviation for r in deviation.per_sample]


def mapped_deviation(tensor: MappedTensor, sources: list[TensorDeviation], norm: float) -> TensorDeviation:
    """The deviation of a mapped tensor from those of its sources, sample by sample: the same for a relayout,
    the root of the squares' sum for a concatenation, the sum (the triangle inequality: an upper bound) for a
    sum; a `scale` op scales it. A `select` keeps the whole source's deviation, an upper bound of its slice's
    (the estimate holds norms of whole tensors, not of slices)."""
    factor = math.prod(abs(op.factor) for op in tensor.ops if isinstance(op, mt.Scale))
    per_source = [_absolute_deviations(source) for source in sources]
    num_samples = min(len(samples) for samples in per_source)
    combine = _combination(tensor)
    combined = []
    for n in range(num_samples):
        parts = [samples[n] for samples in per_source]
        total = sum(parts) if combine == "sum" else math.sqrt(sum(p * p for p in parts))
        combined.append(total * factor)
    deviation = max(combined)
    relative = [c / norm if norm > 0 else (0.0 if c == 0 else math.inf) for c in combined]
    structure = dict(sources[0].structure) if _keeps_structure(tensor) else {}
    return TensorDeviation(key=tensor.key, deviation=deviation, reference_norm=norm,
                           numel=sum(source.numel for source in sources) if combine == "concat" else sources[0].numel,
                           per_sample=relative, structure=structure)


def mapped_estimate(estimate: PerturbationEstimate, mapped: MappedRun) -> PerturbationEstimate:
    """The reference's estimate in the mapped run's names: a tensor whose sources were all estimated gets
    their combined deviation; one with an unestimated source gets none (its tolerance falls back as for any
    tensor the estimate lacks)."""
    tensors = {}
    for tensor in mapped.tensors:
        sources = [estimate.tensors.get(source) for source in tensor.sources]
        if tensor.key in mapped.norms and all(source is not None for source in sources):
            tensors[tensor.key] = mapped_deviation(tensor, sources, mapped.norms[tensor.key])
    return PerturbationEstimate(precision=estimate.precision, num_samples=estimate.num_samples,
                                relative=estimate.relative, reference_precision=estimate.reference_precision,
                                seconds=estimate.seconds, tensors=tensors)
