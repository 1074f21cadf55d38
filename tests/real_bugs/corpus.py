"""The real-bug corpus: silent bugs of distributed training that existed in the wild, each with its
public source, reproduced against the pinned frameworks (requirements.txt) on CPU.

A case is either an upstream fix reverted in a patched copy of the pinned code at run time (the
patch lives with the case and is applied in the candidate run only), or a bug that is still unfixed
in the pinned release, triggered as shipped. Negative controls (`control=True`) are changes that look
like a bug or a fix but are numerically equivalent (a reordering, an equivalent rewrite): ttrace must
pass them.

The cases of each framework live in their own module (megatron_cases.py, pytorch_cases.py,
torchtitan_cases.py, transformers_cases.py), each exporting `CASES: tuple[RealBug, ...]`.
benchmarks/real_bugs.py runs all of them in fp32 and bf16 and writes benchmarks/results/real_bugs.md;
test_ci_slice.py runs one case per framework in CI.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

FRAMEWORKS = ("megatron-core", "pytorch", "torchtitan", "transformers")


@dataclass(frozen=True, kw_only=True)
class RealBug:
    name: str
    """Short id, unique across the corpus ("mcore-moe-aux-loss-dp-scale")."""
    framework: Literal["megatron-core", "pytorch", "torchtitan", "transformers"]
    source: str
    """URL of the public issue or pull request that reports (or fixes) the bug."""
    fix: str | None
    """URL of the fixing PR or commit; None for a bug that is unfixed in the pinned release."""
    reproduced_by: Literal["fix reverted", "as shipped", "control"]
    moe: bool
    """Whether the bug is in MoE or expert-parallel code."""
    summary: str
    """One sentence: what goes wrong numerically, and under which layout."""
    touched: str
    """What the fix touched, in ttrace's terms: a module fqn glob, or "gradient reduction of <params>",
    "gradient norm", "loss", ... The culprit ttrace names is reported against this."""
    expected_culprits: tuple[str, ...]
    """fnmatch globs: the case is localized when a culprit ttrace names matches one of them."""
    record: Callable[[Path, str], tuple[Path, Path]]
    """(work directory, precision "fp32" | "bf16") -> (reference run dir, candidate run dir), both recorded."""
    control: bool = False
    """A negative control: ttrace must pass it."""
    slow: bool = False
    """Runs only in the benchmark, not in the CI slice."""

    def __post_init__(self) -> None:
        if self.framework not in FRAMEWORKS:
            raise ValueError(f"case {self.name!r}: framework {self.framework!r} is not one of {FRAMEWORKS}")
        if not self.source.startswith("https://"):
            raise ValueError(f"case {self.name!r}: source {self.source!r} must be a public URL")
        if self.control != (self.reproduced_by == "control"):
            raise ValueError(f"case {self.name!r}: a control is reproduced_by='control', and only a control")
