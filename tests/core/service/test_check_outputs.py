"""service/check_outputs.py: the Markdown summary's report links."""

from ttrace_core.service.check_outputs import _relative


def test_a_report_inside_the_output_is_linked_relative_to_it():
    assert _relative("/ci/out/reports/fp32-tp2.html", "/ci/out") == "reports/fp32-tp2.html"


def test_a_report_in_a_sibling_folder_that_starts_like_the_output_keeps_its_path():
    # /ci/out-old is not inside /ci/out: a relative link "../out-old/..." would not be what the job uploads
    assert _relative("/ci/out-old/reports/fp32-tp2.html", "/ci/out") == "/ci/out-old/reports/fp32-tp2.html"
