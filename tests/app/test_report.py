"""The shareable HTML report (app/report.py) states the headroom by tensor family, as the CLI does."""

import re

from tests.synthetic_runs import write_pair
from ttrace_core.compare.tolerances import DTYPE_TOLERANCES
from ttrace_dashboard.report import report_html


def _cells(table_html: str, tag: str) -> list[list[str]]:
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", table_html, flags=re.S)
    return [re.findall(rf"<{tag}[^>]*>(.*?)</{tag}>", row, flags=re.S) for row in rows if f"<{tag}" in row]


def test_the_report_has_the_headroom_table_by_tensor_family(tmp_path):
    html = report_html(*write_pair(tmp_path))
    section = html.split("<h2>Headroom by tensor family</h2>", 1)[1].split("<h2>", 1)[0]
    rel = f"{DTYPE_TOLERANCES['float32'][0]:.3g}"  # every float32 tensor of the pair is judged by the dtype table
    assert _cells(section, "th") == [["kind", "tensors", "median", "largest"]]
    # 10 module outputs less the 2 missing in the candidate, and the one parameter gradient
    assert _cells(section, "td") == [["output", "8", rel, rel], ["param_grad", "1", rel, rel]]
