"""The porting benchmark's results hold what docs/porting.md claims (benchmarks/results/porting.json, written by
`python benchmarks/porting.py`): against HF, a correct port is equivalent, every model-code bug fails and is
localized to its module; against the same code on one rank, every bug passes. The one exception is stated in the
docs: in bf16, the epsilon bug is below bf16's round-off and passes against any reference."""

import fnmatch
import json
from collections import defaultdict

import pytest

from tests.support.paths import REPO
from ttrace_examples.megatron_gpt.bugs import MODEL_CODE_CULPRITS
from ttrace_examples.torchtitan.model_bugs import CULPRITS as TORCHTITAN_CULPRITS

RESULTS = json.loads((REPO / "benchmarks" / "results" / "porting.json").read_text())
BELOW_ROUNDOFF = {("bf16", "norm-eps-outside-sqrt")}
"""(suite, bug): a bug whose error is below the suite's round-off (docs/porting.md says which and why)."""
BY_SUITE = defaultdict(list)
for _row in RESULTS["rows"]:
    BY_SUITE[_row["suite"]].append(_row)


def _id(row: dict) -> str:
    return f"{row['suite']}-{row['bug']}-{row['layout']}"


def test_every_suite_has_a_clean_port_and_bugs_at_two_layouts():
    assert {"llama", "bf16", "moe", "torchtitan"} <= set(BY_SUITE)
    for suite, rows in BY_SUITE.items():
        assert any(r["bug"] == "clean" for r in rows) and any(r["bug"] != "clean" for r in rows), suite
        assert len({r["layout"] for r in rows}) == 2, suite


@pytest.mark.parametrize("row", RESULTS["rows"], ids=_id)
def test_each_row_is_what_the_docs_say(row):
    hf, same = row["hf"], row["same_code"]
    if same is not None:
        assert same["verdict"] == "equivalent" and same["num_failing"] == 0
    if row["bug"] == "clean" or (row["suite"], row["bug"]) in BELOW_ROUNDOFF:
        assert hf["verdict"] == "equivalent" and hf["num_failing"] == 0 and hf["max_ratio"] < 1
        return
    assert hf["verdict"] == "not equivalent" and hf["first_ratio"] > 1
    assert row["localized"]["correct"], row["localized"]
    first_module = hf["first_divergence"].split(" / ")[1]
    if row["suite"] == "torchtitan":
        globs = TORCHTITAN_CULPRITS[row["bug"]]
        names = lambda fqn: any(fnmatch.fnmatchcase(fqn, g) or fnmatch.fnmatchcase(fqn, g + ".*") for g in globs)  # noqa: E731
    else:
        names = MODEL_CODE_CULPRITS[row["bug"]].names_module
    assert names(first_module) or any(names(c) for c in row["localized"]["culprits"])


def test_the_bf16_suite_names_a_precision_choice_on_every_hf_verdict():
    assert all(row["hf"]["precision_choices"] for row in BY_SUITE["bf16"])
