from tests.app.test_localize_page import CULPRIT
from tests.synthetic_runs import write_pair
from ttrace_core import api
from ttrace_core.cli.report import render_markdown


def test_the_markdown_summary_carries_verdict_first_divergence_culprit_and_evidence(tmp_path):
    result = api.run_comparison(*write_pair(tmp_path))
    text = render_markdown(result, CULPRIT)
    assert text.startswith("**ttrace: FAILED** (not equivalent) · 3/11 tensors pass")
    # the evidence behind it: layers.1.out was never recorded by the candidate
    assert "- coverage: 9/11 tensors compared element-wise" in text
    assert "- finding: incomplete: 2 tensors missing in the candidate, 0 in the reference" in text
    assert "first divergence: `step 0 / mb 0 / forward / layers.0.act / output.0`: mismatch" in text
    assert "culprit: `layers.0.act` (forward)" in text and "ratio 6e+04 before, 6e+04 with the reference's inputs" in text
    assert "reproduce: `ttrace localize r c`" in text
    assert "localize: `ttrace localize" in render_markdown(result)  # no replay yet: how to run one
