"""How tensors are judged: one settings object from the CLI and the dashboard through compare,
localize and the report.

`CompareSettings` is what `ttrace compare`'s flags set (one field per flag); `ttrace localize`,
`ttrace report`, the dashboard and its replay jobs take the same object, so a replay judges the
candidate exactly as the comparison that sent the user there. `engine.compare_readers` is the one
place that turns settings into a comparison. Imports no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

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

TOLERANCE_KINDS = ("auto", "perturbation", "theorem", "dtype")

MIN_MAX_MEMORY = 2**20
"""The smallest budget `CompareSettings.max_memory` takes."""


@dataclass(kw_only=True, slots=True)
class CompareSettings:
    """How tensors are judged; the CLI's compare flags map one to one onto these fields."""

    tolerance: str = "auto"
    """auto | perturbation | theorem | dtype (tolerances.py)."""
    alpha: float = DEFAULT_ALPHA
    """perturbation: tolerance = alpha x deviation."""
    theorem_k: float = DEFAULT_THEOREM_K
    theorem_c: float = DEFAULT_THEOREM_C
    exact_inputs_k: float = DEFAULT_EXACT_INPUTS_K
    """k of the exact-inputs rule, 0 turns it off."""
    ignore_dtype: bool = False
    partial: bool = False
    """Give a verdict on what was recorded when the evidence is incomplete ("partial", not "incomplete")."""
    max_memory: int | None = None
    """Bytes one tensor's comparison may take; a larger tensor is compared slab by slab (bounded.py).
    None: unbounded."""

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

    def cli_args(self) -> list[str]:
        """The flags that give these settings back on a `ttrace compare | localize | report` command line."""
        args = []
        for spec in fields(self):
            value = getattr(self, spec.name)
            if value == spec.default:
                continue
            flag = "--" + spec.name.replace("_", "-")
            args += [flag] if value is True else [flag, str(value)]
        return args

