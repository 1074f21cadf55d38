"""How tensors are judged: one settings object from the CLI and the dashboard through compare,
localize and the report.

`CompareSettings` is what `ttrace compare`'s flags set: cli/settings_flags.py generates one flag per
field (`CompareSettings.flag`), with the field's docstring as its help and the field's default, so a
field's docstring is written for the user. `ttrace localize`, `ttrace report`, `ttrace check`, the
dashboard and its replay jobs take the same object, so a replay judges the candidate exactly as the
comparison that sent the user there. `engine.compare_readers` is the one place that turns settings
into a comparison. Imports no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Literal, get_args

from ttrace_core.errors import TtraceError

# alpha: ||candidate - reference|| <= ||candidate - exact|| + ||exact - reference||, each term about
# one perturbation deviation, so 2; doubled for the spread of the max over few samples. Calibrated
# on clean layouts only (docs/tolerances.md): their worst error is ~1.1 r_t (fp32), 0.9 (bf16).
DEFAULT_ALPHA = 4.0

# Megatron's adopted defaults (test_optimizer_grads_match.py): "C is close to 1; 1.01-1.05 are
# reasonable", "k absorbs the hidden constant; 2-8 are common choices".
DEFAULT_THEOREM_K = 4.0
DEFAULT_THEOREM_C = 1.03

# The exact-inputs rule (compare/exact_inputs.py): a module fed inputs and parameters bitwise equal to the
# reference's has no inherited round-off, i.e. it sits at depth 0 of the theorem: k * eps, times
# sqrt(n) for a result combined from n partial results (roundings of n terms grow like sqrt(n) u).
DEFAULT_EXACT_INPUTS_K = DEFAULT_THEOREM_K

ToleranceKind = Literal["auto", "perturbation", "theorem", "dtype"]
TOLERANCE_KINDS: tuple[str, ...] = get_args(ToleranceKind)

MIN_MAX_MEMORY = 2**20
"""The smallest budget `CompareSettings.max_memory` takes."""


@dataclass(kw_only=True, slots=True)
class CompareSettings:
    """How tensors are judged; each field is one flag of the commands that judge (cli/settings_flags.py)."""

    tolerance: ToleranceKind = "auto"
    """How each tensor's tolerance is derived: perturbation from the reference's re-runs (`ttrace
    estimate`), theorem k * C^depth * eps, dtype a per-dtype table, or auto: perturbation when the
    reference holds an estimate, else dtype (compare/tolerances.py)."""
    alpha: float = DEFAULT_ALPHA
    """perturbation: tolerance = alpha x the deviation the re-runs measured."""
    theorem_k: float = DEFAULT_THEOREM_K
    """theorem: k in k * C^depth * eps."""
    theorem_c: float = DEFAULT_THEOREM_C
    """theorem: C in k * C^depth * eps."""
    exact_inputs_k: float = DEFAULT_EXACT_INPUTS_K
    """perturbation/theorem: a tensor whose inputs and weights were bitwise equal to the reference's
    is also held to k * sqrt(n) * eps, n partial results (0: off)."""
    ignore_dtype: bool = False
    """Compare values even when dtypes differ."""
    partial: bool = False
    """When the evidence is incomplete (a step, a tensor or a replica missing), give a verdict on what
    was recorded: 'partial' and how much, exit 0 if it all passes (without it: 'incomplete', exit 1)."""
    max_memory: int | None = field(default=None, metadata={"unit": "bytes"})
    """Bytes one tensor's comparison may take (512M, 4G); larger tensors are compared slab by slab
    (compare/bounded.py). Unset: unbounded."""

    def __post_init__(self) -> None:
        if self.tolerance not in TOLERANCE_KINDS:
            raise TtraceError(f"tolerance {self.tolerance!r}: choose from {', '.join(TOLERANCE_KINDS)}")
        if self.max_memory is not None and self.max_memory < MIN_MAX_MEMORY:
            raise TtraceError(f"max_memory {self.max_memory} bytes is too small to compare anything; "
                              f"give at least {MIN_MAX_MEMORY // 2**20} MiB")

    def engine_options(self) -> dict:
        """The keyword arguments of `compare_runs` these settings set."""
        return dict(ignore_dtype=self.ignore_dtype, exact_inputs_k=self.exact_inputs_k, partial=self.partial,
                    max_bytes=self.max_memory)

    def to_data(self) -> dict:
        return asdict(self)

    @staticmethod
    def flag(name: str) -> str:
        """The command-line flag of field `name`: "--theorem-k" for theorem_k."""
        return "--" + name.replace("_", "-")

    def cli_args(self) -> list[str]:
        """The flags that give these settings back on a `ttrace compare | localize | report` command line."""
        args = []
        for spec in fields(self):
            value = getattr(self, spec.name)
            if value == spec.default:
                continue
            args += [self.flag(spec.name)] if value is True else [self.flag(spec.name), str(value)]
        return args

