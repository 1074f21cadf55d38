"""The result types of stage 3 (compare), and their one serialized form.

Every later stage reads these: the table (compare/table.py), localize, the report, the dashboard.
`ComparisonStatus` names every way a row can end, `Tolerance` is the bound a tensor was judged against,
`TensorComparison` one row of a comparison,
`Coverage` how much evidence a verdict rests on, `KindHeadroom` the smallest error it could have
caught on a tensor kind, `RunComparison` the whole comparison and `VerdictSummary` the verdict with
its first divergence, which both the terminal and the dashboard put into words here, once.

Serialized form: `format.records.data_from_record` (msgspec's builtins) writes each record as plain
JSON data and `record_from_data` reads it back, type-checked. The `--json` output, a partitioned
worker's rows, the Parquet table's columns (table.py maps each column to a path in that form) and the
table's provenance all use it.

Imports no torch: `ttrace_core.api` hands these to the dashboard without loading the tensor stack.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from enum import StrEnum

from ttrace_core.canonicalize.replicas import ReplicaDrift
from ttrace_core.format import strict_json
from ttrace_core.format.naming import KINDS, tensor_id, tensor_kind
from ttrace_core.format.records import data_from_json, data_from_record, record_from_data
from ttrace_core.format.schema import TensorKey


class ComparisonStatus(StrEnum):
    """How a comparison row ends: "pass", or why its tensor fails. A str: the JSON output and the table's
    `status` column hold its value ("replica_drift"), which it equals, and decoding checks that it is one."""

    PASS = "pass"
    MISMATCH = "mismatch"
    """Values differ from the reference's beyond the tolerance (the norm test, or a structure test)."""
    REPLICA_DRIFT = "replica_drift"
    """The candidate's copies of the tensor differ from each other beyond the tolerance's drift_rel."""
    NONFINITE = "nonfinite"
    """NaN or Inf in other numbers, or in other places, than the reference's."""
    MISSING = "missing"
    """Recorded in the reference only."""
    EXTRA = "extra"
    """Recorded in the candidate only."""
    SHAPE = "shape"
    DTYPE = "dtype"
    LAYOUT = "layout"
    """Its shards cannot be put together into the logical tensor (canonicalize refused their layout)."""
    INCONSISTENT = "inconsistent"
    """Its shards' metadata disagree (evidence.py), found before any value is read."""


VALUE_STATUSES = frozenset({ComparisonStatus.PASS, ComparisonStatus.MISMATCH, ComparisonStatus.REPLICA_DRIFT})
"""The statuses of a row judged on its values by ratios (structure tests may still turn a pass into a failure)."""
STRUCTURAL_STATUSES = frozenset({ComparisonStatus.MISSING, ComparisonStatus.EXTRA, ComparisonStatus.SHAPE,
                                 ComparisonStatus.DTYPE, ComparisonStatus.LAYOUT})
"""The statuses of a row that failed on structure (key sets, shape, dtype, layout), before any value."""


@dataclass(frozen=True, slots=True)
class Tolerance:
    rel: float
    abs: float
    source: str
    """Where the numbers come from, shown next to every verdict ("dtype default (float32)")."""
    drift_rel: float | None = None
    """How far the candidate's replicas of the tensor may differ (relative); None: as far as `rel`."""
    method: str = ""
    """"dtype", "perturbation", "perturbation-floor", "theorem" or "exact-inputs"."""
    params: tuple[tuple[str, float], ...] = ()
    """The numbers the method used, e.g. (("alpha", 4.0), ("r_t", 2e-7), ("samples", 4))."""


@dataclass(kw_only=True, slots=True)
class Coverage:
    """How much evidence stands behind a verdict. "equivalent" needs `full`: every expected tensor
    compared element-wise (or, in a run recorded in stats-only mode, by statistics) on every copy,
    over every expected step (`expected_steps`)."""

    tensors_expected: int = 0
    """Logical tensors either run recorded in the compared steps (the fp8-only quantization scales,
    which a higher-precision reference cannot have, excluded)."""
    compared_elementwise: int = 0
    compared_by_stats: int = 0
    missing_in_candidate: int = 0
    missing_in_reference: int = 0
    not_compared: int = 0
    """Tensors judged on structure alone (dtype, shape, layout or metadata disagree)."""
    copies_expected: int = 0
    copies_present: int = 0
    ranks_expected: int = 0
    ranks_present: int = 0
    steps_expected: list[int] = field(default_factory=list)
    """The candidate's steps and the reference's up to the candidate's last (`expected_steps`)."""
    steps_compared: list[int] = field(default_factory=list)
    stats_only_run: bool = False
    """One of the runs was recorded in stats-only mode by the user's choice."""
    missing_copies: list[str] = field(default_factory=list)
    """The first few tensors with copies missing: "KEY: 1 of 2 copies (ranks [0])"."""
    inventory_gaps: list[str] = field(default_factory=list)
    """Step files holding fewer tensors than their writer recorded."""
    unrecorded: int = 0
    """Tensors of the compared steps a run's tracer left out with a finding (counted in tensors_expected,
    compared in neither run)."""
    recording_findings: list[str] = field(default_factory=list)
    """What either run's tracer could not record, one line per distinct finding ("candidate: FQN SLOT: what
    is wrong; what to do (2 times: ranks [0], steps [0])")."""
    reference_trained: bool | None = None
    """The negative control (liveness.py): False when the reference did not train in the compared steps
    (every gradient zero, or no parameter moved), which refuses any pass; None when its trace cannot tell."""
    dead_reference: str = ""
    """What shows that the reference did not train: "every one of its 4 parameter gradients is zero at step 0"."""
    unmapped: int = 0
    """Against a reference of another implementation (a correspondence map, docs/porting.md): tensors of either
    run the map declares without counterpart, listed by reason in `unmapped_reasons`; not compared, and not
    missing evidence (the map says why they have none)."""
    unmapped_reasons: list[str] = field(default_factory=list)
    """One line per reason: "candidate: <the map's reason> (12 tensors, e.g. forward/rotary_pos_emb/output.0)"."""
    unaccounted: list[str] = field(default_factory=list)
    """The first few tensors the map neither relates nor declares: "reference: backward/lm_head/grad_input.0"."""
    num_unaccounted: int = 0
    """How many such tensors: the evidence is incomplete until the map says what each is."""

    @property
    def stats_only_tensors_in_full_run(self) -> int:
        return 0 if self.stats_only_run else self.compared_by_stats

    @property
    def full(self) -> bool:
        compared = self.compared_elementwise + (self.compared_by_stats if self.stats_only_run else 0)
        return (compared == self.tensors_expected and self.copies_present >= self.copies_expected
                and self.steps_compared == self.steps_expected and self.ranks_present == self.ranks_expected
                and not self.inventory_gaps and not self.recording_findings and not self.num_unaccounted)

    def refusal(self) -> str | None:
        """Why no pass can be given, whatever the tensors say (the reference did not train); None when one can."""
        if self.reference_trained is not False:
            return None
        return (f"the reference did not train: {self.dead_reference}; check that the reference's loss reaches "
                "backward (a detached loss or lr 0 makes a pass meaningless)")

    def findings(self) -> list[str]:
        """Named findings, one line each: `refused` (the reference did not train), `incomplete`, `unrecorded`
        (the tracer's findings), `missing-replica`."""
        found = [f"refused: {refusal}"] if (refusal := self.refusal()) is not None else []
        if missing_steps := [s for s in self.steps_expected if s not in self.steps_compared]:
            found.append(f"incomplete: steps {missing_steps} were not compared (partial or in one run only)")
        if self.ranks_present < self.ranks_expected:
            found.append(f"incomplete: {self.ranks_present} of {self.ranks_expected} ranks hold a compared step")
        if self.missing_in_candidate or self.missing_in_reference:
            found.append(f"incomplete: {self.missing_in_candidate} tensors missing in the candidate, "
                         f"{self.missing_in_reference} in the reference")
        if self.not_compared:
            found.append(f"incomplete: {self.not_compared} tensors could not be compared by value (see their rows)")
        if self.stats_only_tensors_in_full_run:
            found.append(f"incomplete: {self.compared_by_stats} tensors hold statistics only, in runs recorded in full")
        found += [f"incomplete: {gap}" for gap in self.inventory_gaps]
        found += [f"unrecorded: {line}" for line in self.recording_findings]
        if self.num_unaccounted:
            found.append(f"unmapped: {self.num_unaccounted} tensors have no counterpart through the map and no "
                         f"[[unmapped]] entry, e.g. {self.unaccounted[0]}; relate them in the map or declare them "
                         "(docs/porting.md)")
        if self.copies_present < self.copies_expected:
            example = f", e.g. {self.missing_copies[0]}" if self.missing_copies else ""
            found.append(f"missing-replica: {self.copies_expected - self.copies_present} of {self.copies_expected} "
                         f"expected copies were not recorded{example}")
        return found

    def summary(self) -> str:
        by_stats = f", {self.compared_by_stats} by statistics only" if self.compared_by_stats else ""
        return (f"{self.compared_elementwise}/{self.tensors_expected} tensors compared element-wise{by_stats}; "
                f"{self.copies_present}/{self.copies_expected} copies; {self.ranks_present}/{self.ranks_expected} ranks; "
                f"steps {self.steps_compared} of {self.steps_expected}"
                + (f"; {self.unmapped} without counterpart through the map" if self.unmapped else ""))





@dataclass(kw_only=True, slots=True)
class StructureTest:
    """One test of the error's structure (compare/structure.py), next to the norm test: its statistic,
    the noise level the perturbation estimate gives that statistic, and their ratio (<= 1 passes)."""

    name: str
    """"scale" (projection of the error on the reference), "offset" (the part of the error constant
    along the token dims), "bias" (that part as a multiple of the module's own bias), "shard" (the worst
    shard's error against that shard's values), "update"
    (a post-step parameter's change against the update's noise)."""
    value: float
    """The statistic: a relative scale (-0.5 for a halved tensor), a relative norm, ..."""
    tolerance: float
    """alpha x the largest |statistic| over the perturbed re-runs (floored)."""
    ratio: float
    finding: str = ""
    """The transform it reads off the error, in words: "scaled by 0.500 (x0.5 +/- 0.004 under round-off)"."""


@dataclass(kw_only=True, slots=True)
class TensorComparison:
    key: TensorKey
    status: ComparisonStatus
    """PASS, or why it fails; a plain string given here is checked and made one."""
    message: str = ""
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    error: float | None = None
    """Relative error ||actual - expected||_F / ||expected||_F, in float64."""
    abs_error: float | None = None
    """||actual - expected||_F."""
    reference_norm: float | None = None
    tolerance: Tolerance | None = None
    ratio: float | None = None
    """The ratio that judged the tensor: the larger of `value_ratio` and `drift_ratio` (`decided_by`
    names which); <= 1 passes."""
    value_ratio: float | None = None
    """||actual - expected||_F / (rel * ||expected||_F + abs * sqrt(numel))."""
    drift_ratio: float | None = None
    """How far the candidate's replicas disagree, in units of the tolerance's drift_rel (0: none)."""
    min_rel_tolerance: float | None = None
    """The smallest rel that would have passed with the same abs."""
    max_abs_diff: float | None = None
    max_abs_index: tuple[int, ...] | None = None
    max_rel_diff: float | None = None
    max_rel_index: tuple[int, ...] | None = None
    num_mismatched: int | None = None
    """Elements outside abs + rel * |expected|."""
    numel: int | None = None
    num_nan: tuple[int, int] = (0, 0)
    """(candidate, reference)."""
    num_inf: tuple[int, int] = (0, 0)
    num_nonfinite_apart: int = 0
    """Elements NaN or Inf in one run and not the same value in the other (equal counts in other places fail too)."""
    replica_drift: ReplicaDrift | None = None
    """The candidate's replicas that differ most (canonicalize/replicas.py); None when all are bitwise equal."""
    stats_only: bool = False
    structure: list[StructureTest] = field(default_factory=list)
    """The structure tests run on this tensor (empty without a perturbation estimate that measured them)."""
    decided_by: str | None = None
    """Which test gave `ratio`: "mismatch" (the norm test), "replica drift", or a structure test's name
    ("scale", "offset", "bias", "shard", "update"); None for a row not compared by value."""
    detectable: float | None = None
    """The smallest relative error ||actual - expected|| / ||expected|| that one of this row's tests
    would catch: the headroom of a pass (a tensor scaled by 1 + s fails the scale test once |s| is above it).
    Finished when the row is made (`detectable_of`): the norm test's tolerance where no structure test set a
    smaller figure, None where the row was not compared element-wise."""

    @property
    def passed(self) -> bool:
        return self.status == ComparisonStatus.PASS

    def __post_init__(self) -> None:
        if type(self.status) is not ComparisonStatus:
            self.status = ComparisonStatus(self.status)
        self.detectable = row_detectable(self)
        if self.decided_by is None and self.value_ratio is not None:  # a row judged by the norm test alone
            self.decided_by = "replica drift" if (self.drift_ratio or 0.0) > self.value_ratio else "mismatch"

    @property
    def exact(self) -> bool:
        """Bitwise equal to the reference, on every replica."""
        return self.passed and not self.stats_only and self.abs_error == 0 and self.replica_drift is None \
            and self.num_nan[0] == 0 and self.num_inf[0] == 0

    def __bool__(self) -> bool:
        return self.passed

    def to_dict(self) -> dict:
        """The serialized form (`data_from_record`), with `decided_by` for readers of the JSON."""
        return data_from_record(self)

    @staticmethod
    def from_dict(data: dict, where: str = "comparison row") -> TensorComparison:
        return record_from_data(data, TensorComparison, where, "comparison row", "compare the runs again")


def detectable_of(detectable: float | None, tolerance_rel: float | None, compared_elementwise: bool) -> float | None:
    """The smallest relative error a row's tests catch: its own `detectable`, else the norm test's, which fails
    a tensor once its relative error exceeds about `tolerance_rel`. None for a row not compared element-wise: a
    comparison of norms (statistics only) misses an error of any size that keeps the norm."""
    if not compared_elementwise:
        return None
    return detectable if detectable is not None else tolerance_rel


def row_detectable(c: TensorComparison) -> float | None:
    """A row's finished `detectable`, also for a row whose fields were set after it was made."""
    return detectable_of(c.detectable, c.tolerance.rel if c.tolerance else None,
                         c.value_ratio is not None and not c.stats_only)


@dataclass(kw_only=True, slots=True)
class KindHeadroom:
    """The smallest relative error ||actual - expected|| / ||expected|| a verdict could have caught on one tensor
    kind (format.naming.KINDS), over its rows compared element-wise."""

    kind: str
    num_tensors: int
    """Rows (tensor instances over steps and micro-batches) of the kind."""
    median: float
    largest: float
    """The honest figure: an error up to this size on some tensor of the kind could have passed."""


def headroom_by_kind(rows: list[TensorComparison]) -> list[KindHeadroom]:
    """Per tensor kind, in heatmap order, the median and the largest of its rows' detectable errors."""
    by_kind: dict[str, list[float]] = {}
    for row in rows:
        if (detectable := row_detectable(row)) is not None and not math.isnan(detectable):
            by_kind.setdefault(tensor_kind(row.key), []).append(detectable)
    order = {kind: index for index, kind in enumerate(KINDS)}
    return [KindHeadroom(kind=kind, num_tensors=len(values), median=statistics.median(values), largest=max(values))
            for kind, values in sorted(by_kind.items(), key=lambda item: (order.get(item[0], len(order)), item[0]))]


@dataclass(kw_only=True, slots=True)
class RunComparison:
    reference: str
    candidate: str
    comparisons: list[TensorComparison] = field(default_factory=list)
    steps_compared: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Partial or unmatched steps that were not compared."""
    coverage: Coverage | None = None
    """How much evidence the verdict rests on (evidence.py); None in comparisons from before it existed."""
    partial_allowed: bool = False
    """The user asked for a verdict on what was recorded (`--partial`): incomplete evidence then
    passes as "partial" instead of failing as "incomplete"."""

    @property
    def verdict(self) -> str:
        """"equivalent", "equivalent by statistics", "partial" (pass); "refused", "incomplete", "not equivalent"
        (fail). "refused" comes first: against a reference that did not train, agreeing or not says nothing."""
        if self.coverage is not None and self.coverage.refusal() is not None:
            return "refused"
        if not self.comparisons or not all(self.comparisons):
            return "not equivalent"
        if self.coverage is None or self.coverage.full:
            by_stats = self.coverage is not None and self.coverage.stats_only_run and self.coverage.compared_by_stats
            return "equivalent by statistics" if by_stats else "equivalent"
        return "partial" if self.partial_allowed else "incomplete"

    @property
    def passed(self) -> bool:
        return self.verdict in ("equivalent", "equivalent by statistics", "partial")

    @property
    def headroom(self) -> list[KindHeadroom]:
        """The smallest error this verdict could have caught, per tensor kind (the headroom of a pass)."""
        return headroom_by_kind(self.comparisons)

    @property
    def findings(self) -> list[str]:
        """Why the verdict is refused, and what the evidence lacks, one named line each (`refused: ...`,
        `incomplete: ...`, `missing-replica: ...`)."""
        return self.coverage.findings() if self.coverage is not None else []

    def __bool__(self) -> bool:
        return self.passed

    @property
    def failures(self) -> list[TensorComparison]:
        return [c for c in self.comparisons if not c]

    @property
    def first_divergence(self) -> TensorComparison | None:
        return next((c for c in self.comparisons if not c), None)

    def worst(self, count: int) -> list[TensorComparison]:
        def badness(c: TensorComparison) -> float:
            if c.ratio is None:
                return math.inf if not c else 0.0
            return c.ratio
        return sorted(self.comparisons, key=badness, reverse=True)[:count]

    def to_dict(self) -> dict:
        """The serialized form: the summary's header (verdict, passed, ...), then the record with each row's form."""
        data = data_from_record(self)
        data["comparisons"] = [c.to_dict() for c in self.comparisons]
        return {**self.summary().header(), **data}

    def to_json(self) -> str:
        """Strict JSON: a NaN or infinite number (the ratio of a tensor with NaNs) is written as null."""
        return strict_json.dumps(self.to_dict(), indent=1)

    @staticmethod
    def from_json(text: str, where: str = "comparison") -> RunComparison:
        data = data_from_json(text, where, "comparison", "compare the runs again")
        return record_from_data(data, RunComparison, where, "comparison", "compare the runs again")

    def summary(self) -> VerdictSummary:
        first = self.first_divergence
        return VerdictSummary(
            verdict=self.verdict, passed=self.passed, findings=self.findings, coverage=self.coverage, headroom=self.headroom,
            first_divergence=None if first is None else FirstDivergence(
                tensor=tensor_id(first.key), step=first.key.step, micro_batch=first.key.micro_batch))


@dataclass(kw_only=True, slots=True)
class FirstDivergence:
    tensor: str
    """"phase/fqn/slot" (format.naming.tensor_id)."""
    step: int
    micro_batch: int


@dataclass(kw_only=True, slots=True)
class VerdictSummary:
    """A comparison's verdict and what it rests on; the table's provenance holds these same fields."""

    verdict: str
    passed: bool
    findings: list[str] = field(default_factory=list)
    coverage: Coverage | None = None
    first_divergence: FirstDivergence | None = None
    headroom: list[KindHeadroom] = field(default_factory=list)
    """Per tensor kind, the smallest relative error the verdict could have caught (RunComparison.headroom)."""

    def headline(self) -> str:
        """"PASSED (equivalent)", "PASSED (partial: ...)", "FAILED (incomplete)", "FAILED (not equivalent)"."""
        verdict = self.verdict
        if verdict == "partial" and self.coverage is not None:
            verdict = f"partial: {self.coverage.summary()}"
        return f"{'PASSED' if self.passed else 'FAILED'} ({verdict})"

    def banner(self) -> tuple[str, str]:
        """(level, text) for a page's banner: level "success", "warning" (a partial verdict) or "error"; the
        text names the first divergence, or what the evidence lacks, and how much evidence stands behind it."""
        evidence = f"Evidence: {self.coverage.summary()}." if self.coverage is not None else ""
        if self.verdict in ("equivalent", "equivalent by statistics"):
            return "success", f"PASSED ({self.verdict}): the candidate matches the reference. {evidence}"
        if self.verdict == "refused" and self.coverage is not None:
            return "error", f"FAILED (refused): {self.coverage.refusal()}. {evidence}"
        findings = "; ".join(self.findings)
        if self.verdict == "partial":
            return "warning", f"PASSED (partial): what was recorded matches, but {findings}. {evidence}"
        first = self.first_divergence
        if first is None:
            return "error", f"FAILED ({self.verdict}): {findings}. {evidence}"
        mb = "" if first.micro_batch < 0 else f" mb {first.micro_batch}"
        return "error", f"FAILED ({self.verdict}): first divergence at `{first.tensor}` (step {first.step}{mb}). {evidence}"

    def header(self) -> dict:
        """The fields `--json` writes before the comparison's own: passed, verdict, findings, headroom."""
        return {"passed": self.passed, "verdict": self.verdict, "findings": self.findings,
                "headroom": [data_from_record(kind) for kind in self.headroom]}

    @staticmethod
    def from_provenance(provenance: dict, where: str = "comparison table") -> VerdictSummary:
        """The summary's own fields of a table's provenance, which also holds the runs, settings and versions."""
        own = {name: value for name, value in provenance.items() if name in VerdictSummary.__dataclass_fields__}
        return record_from_data(own, VerdictSummary, where, "comparison table's provenance", "compare the runs again")
