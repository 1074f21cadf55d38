from tests.app.test_localize_page import CULPRIT
from tests.synthetic_runs import write_pair
from ttrace_core import api
from ttrace_core.cli.report import render_comparison, render_markdown
from ttrace_core.compare.tolerances import DTYPE_TOLERANCES


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


def test_the_terminal_summary_has_the_headroom_table_by_tensor_family(tmp_path):
    """Per kind: its tensors compared by value, the median and the largest of their detectable errors (a row
    without one counts with the norm test's tolerance); missing tensors are not in it."""
    result = api.run_comparison(*write_pair(tmp_path))
    outputs = [c for c in result.comparisons if c.key.phase == "forward" and c.value_ratio is not None]
    detectables = [None, 2e-4, 3e-4, 4e-4, 5e-4, 6e-4, 7e-4, 9e-4]
    assert len(outputs) == len(detectables)  # 10 module outputs, the 2 of layers.1.out missing in the candidate
    for row, detectable in zip(outputs, detectables):
        row.detectable = detectable
    float32_rel = DTYPE_TOLERANCES["float32"][0]
    lines = render_comparison(result).splitlines()
    start = lines.index("headroom by tensor family (the smallest relative error the verdict catches):")
    assert [line.split() for line in lines[start + 1:start + 4]] == [
        ["kind", "tensors", "median", "largest"],
        ["output", "8", f"{(4e-4 + 5e-4) / 2:.3g}", f"{9e-4:.3g}"],
        ["param_grad", "1", f"{float32_rel:.3g}", f"{float32_rel:.3g}"],
    ]
    assert lines[start + 4].startswith("coverage: ")
