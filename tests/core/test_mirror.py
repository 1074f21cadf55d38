"""tests/core mirrors ttrace_core: `ttrace_core/<package>/<module>.py` is tested by
`tests/core/<package>/test_<module>.py` where it has behaviour of its own (issue 42). The framework
adapters' tests, which run real megatron-core, fp8 emulation and DTensor, are tests/integrations/.

Every core module is in exactly one of three places: it has that test module; or it is tested where
its behaviour shows (COVERED_ELSEWHERE names the test file, and that file must name the module: an
import of it or its path); or it has no behaviour to test (NO_BEHAVIOUR says why). A new module, a
moved test, or a table entry gone stale fails here. Every test module under tests/core/<package>/ is
named after a module of that package, or EXTRA_TESTS says what it tests instead.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.paths import REPO

CORE = REPO / "ttrace_core"
TESTS = REPO / "tests" / "core"

COVERED_ELSEWHERE = {
    "cli/check": ("tests/test_check.py", "`ttrace check` end to end: config, gate, outputs"),
    "cli/main": ("tests/test_cli.py", "every command as a user runs it"),
    "cli/worker": ("tests/core/service/test_warm_worker.py", "the warm worker's loop, which service/warm_worker.start runs"),
    "record/warm_client": ("tests/core/service/test_warm_worker.py", "the protocol's client side, against the worker it asks"),
    "compare/estimate_file": ("tests/core/workflows/test_estimate.py", "the estimate is written and read back"),
    "compare/settings": ("tests/core/cli/test_settings_flags.py", "its fields are the compare flags"),
    "compare/step_scalars": ("tests/core/compare/test_tolerances.py", "step-scalar tolerances"),
    "format/findings": ("tests/faults/meta_rows.py", "findings rewritten and read back by the damaged-trace tests"),
    "format/global_heap": ("tests/faults/pristine.py", "looping global heaps refused (tests/test_damaged_traces.py)"),
    "format/reader": ("tests/core/format/test_writer.py", "what the writer stores, read back"),
    "format/same_storage": ("tests/core/format/test_tensor_index.py", "a tensor recorded twice is one copy"),
    "format/schema": ("tests/core/canonicalize/test_placements.py", "Layout validation"),
    "format/shard_reads": ("tests/core/format/test_tensor_index.py", "shards read by index"),
    "format/strict_json": ("tests/test_json_output.py", "--json output is strict JSON"),
    "integrations/dtensor": ("tests/distributed/workers.py", "real DTensor layouts on gloo ranks"),
    "integrations/megatron_moe": ("tests/examples/test_megatron_moe.py", "megatron's experts traced by token"),
    "integrations/shipped_maps": ("tests/core/canonicalize/test_correspondence.py", "every shipped map loads"),
    "integrations/torchtitan": ("tests/thirdparty/test_torchtitan.py", "torchtitan's own trainer"),
    "integrations/transformers": ("tests/thirdparty/test_transformers_tp.py", "transformers' tensor parallelism"),
    "record/adapters": ("tests/thirdparty/test_torchtitan_experts.py", "torchtitan's experts by token"),
    "record/launch": ("tests/distributed/test_launch.py", "spawned ranks, timeouts, dead ranks"),
    "record/token_rows": ("tests/core/canonicalize/test_token_rows.py", "routed rows recorded by token"),
    "service/check": ("tests/test_check.py", "`ttrace check` end to end"),
    "service/check_config": ("tests/test_check.py", "the check config decoded, typos suggested"),
    "service/comparison_jobs": ("tests/app/test_streamed_comparison.py", "a comparison streamed to a page"),
    "service/dashboard": ("tests/app/test_dashboard_command.py", "`ttrace dashboard`"),
    "service/tensor_view": ("tests/app/test_cells.py", "the tensor page's view"),
    "workflows/adaptive": ("tests/examples/test_adaptive_capture.py", "statistics first, values where they diverge"),
    "workflows/localize": ("tests/core/localize/test_verdicts.py", "replays and their verdicts"),
    "workflows/mapped_reference": ("tests/core/canonicalize/test_mapped_run.py", "the mapped reference kept up to date"),
}
"""Core module -> (the test file where its behaviour is tested, what of it)."""

NO_BEHAVIOUR = {
    "__main__": "`python -m ttrace_core`: calls cli.main",
    "errors": "the exception classes; each is raised and its message checked where it is raised",
}
EXTRA_TESTS = {
    "record/test_fsdp_view_warning.py": "the FSDP2 view warning ttrace's own backward hooks cause (record/module_hooks.py)",
}


def _core_modules() -> list[str]:
    return sorted(str(path.relative_to(CORE).with_suffix("")) for path in CORE.rglob("*.py")
                  if path.name != "__init__.py" and "__pycache__" not in path.parts and "maps" not in path.parts)


def _own_test(module: str) -> Path:
    package, _, name = module.rpartition("/")
    if package == "integrations":
        return REPO / "tests" / "integrations" / f"test_{name}.py"
    return TESTS / package / f"test_{name}.py"


def _names(text: str, module: str) -> bool:
    """The test file imports the module or names its path."""
    package, _, name = module.rpartition("/")
    dotted = f"ttrace_core.{package}.{name}" if package else f"ttrace_core.{name}"
    return (re.search(rf"\b{re.escape(dotted)}\b", text) is not None or f"{module}.py" in text
            or re.search(rf"from ttrace_core\.{re.escape(package)} import [^\n]*\b{name}\b", text) is not None)


MODULES = _core_modules()


def test_every_core_module_is_in_exactly_one_place():
    owned = {module for module in MODULES if _own_test(module).exists()}
    placed = {module: [where for where, table in (("own test", owned), ("COVERED_ELSEWHERE", COVERED_ELSEWHERE),
                                                     ("NO_BEHAVIOUR", NO_BEHAVIOUR)) if module in table]
              for module in MODULES}
    unplaced = sorted(module for module, where in placed.items() if not where)
    twice = sorted(f"{module}: {', '.join(where)}" for module, where in placed.items() if len(where) > 1)
    assert unplaced == [], f"give each a test module tests/core/<package>/test_<module>.py: {unplaced}"
    assert twice == [], f"a module with its own test leaves the other tables: {twice}"
    stale = sorted(set(COVERED_ELSEWHERE) | set(NO_BEHAVIOUR) - set(MODULES))
    assert sorted(set(COVERED_ELSEWHERE) - set(MODULES)) == [] and sorted(set(NO_BEHAVIOUR) - set(MODULES)) == [], stale


@pytest.mark.parametrize("module", sorted(COVERED_ELSEWHERE))
def test_a_module_covered_elsewhere_is_named_by_that_test(module):
    where, _ = COVERED_ELSEWHERE[module]
    path = REPO / where
    assert path.exists(), f"{module}: {where} does not exist"
    assert _names(path.read_text(), module), f"{where} neither imports ttrace_core's {module} nor names {module}.py"


def test_every_test_module_under_a_package_is_named_after_one_of_its_modules():
    strays = []
    for path in sorted(TESTS.glob("*/test_*.py")):
        relative = str(path.relative_to(TESTS))
        package = path.parent.name
        module = f"{package}/{path.stem.removeprefix('test_')}"
        if module not in MODULES and relative not in EXTRA_TESTS:
            strays.append(relative)
    assert strays == [], f"name each after the module it tests, or say why in EXTRA_TESTS: {strays}"


@pytest.mark.parametrize("text, module, expected", [
    ("from ttrace_core.format.reader import RunReader", "format/reader", True),
    ("from ttrace_core.format import reader", "format/reader", True),
    ("see ttrace_core/format/reader.py", "format/reader", True),
    ("from ttrace_core.format.reader_extra import x", "format/reader", False),
    ("from ttrace_core.format import readers", "format/reader", False),
], ids=["from-module", "from-package", "path", "longer-module", "longer-name"])
def test_names_finds_a_module_by_whole_name(text, module, expected):
    assert _names(text, module) is expected
