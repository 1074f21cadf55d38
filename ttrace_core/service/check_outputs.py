"""What `ttrace check` writes for a CI system (check.py's `CheckResult`):

- JUnit XML: one test case per layout and precision; a failure's message is its first divergence, ratio
  and culprit, its body the verdict's findings and worst tensors; a layout whose command failed is an
  error with its log's tail;
- a Markdown summary of at most 1 MiB (a GitHub step summary or a review comment): a table of layouts
  with verdict, first divergence, culprit and report, then each failure's details;
- one JSON file with every verdict, its coverage and its findings (strict JSON: no NaN).
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from dataclasses import asdict
from pathlib import Path

from ttrace_core.format import strict_json
from ttrace_core.service.check import CheckResult, LayoutResult

MAX_MARKDOWN_BYTES = 2**20
"""GitHub's step summary takes at most 1 MiB per step."""
OUTCOME_MARKS = {"equivalent": "✅ equivalent", "not equivalent": "❌ not equivalent", "error": "⚠️ error"}


def junit_xml(check: CheckResult) -> str:
    layouts = check.layouts
    suite = ET.Element("testsuite", name="ttrace check", tests=str(len(layouts)),
                       failures=str(sum(r.outcome == "not equivalent" for r in layouts)),
                       errors=str(sum(r.outcome == "error" for r in layouts)), time=f"{check.seconds:.3f}")
    for found in layouts:
        case = ET.SubElement(suite, "testcase", classname=f"ttrace.{found.precision}", name=found.name,
                             time=f"{sum(found.seconds.values()):.3f}")
        if found.outcome == "not equivalent":
            failure = ET.SubElement(case, "failure", message=found.message, type=found.verdict)
            failure.text = "\n".join([found.message, *found.details, *([f"report: {found.report}"] if found.report else [])])
        elif found.outcome == "error":
            error = ET.SubElement(case, "error", message=found.message, type="layout error")
            error.text = "\n".join([found.message, f"log: {found.log}", *found.log_tail])
        ET.SubElement(case, "system-out").text = f"layout: {found.layout or '(none)'}; world size {found.world_size}; " \
                                                 f"run: {found.run_dir}; recording {'reused' if found.reused else 'new'}"
    root = ET.Element("testsuites", name="ttrace check")
    root.append(suite)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") or "-"


def _relative(path: str, output: str) -> str:
    """A report's path from the output directory (where the summary is, and what a CI job uploads)."""
    inside = os.path.isabs(path) and Path(path).is_relative_to(output)  # not a sibling folder `output` + "-b"
    return os.path.relpath(path, output) if inside else path


def _row(found: LayoutResult, output: str) -> str:
    ratio = "-" if found.ratio is None else f"{found.ratio:.3g}"
    first = f"`{found.first_divergence}`" if found.first_divergence else "-"
    report = f"[report]({_relative(found.report, output)})" if found.report else "-"
    verdict = OUTCOME_MARKS[found.outcome]
    if found.outcome == "error":
        verdict += f": {_cell(found.message)}"
    elif found.verdict not in ("", found.outcome):  # refused, incomplete, partial, by statistics
        verdict += f" ({found.verdict})"
    return f"| {_cell(found.name)} | {found.precision} | {verdict} | {first} | {ratio} | {_cell(found.culprit)} | {report} |"


def markdown_summary(check: CheckResult, max_bytes: int = MAX_MARKDOWN_BYTES) -> str:
    counts = {outcome: sum(r.outcome == outcome for r in check.layouts) for outcome in OUTCOME_MARKS}
    lines = [f"## ttrace check: {len(check.layouts)} layouts, {counts['equivalent']} equivalent, "
             f"{counts['not equivalent']} not equivalent, {counts['error']} errors", "",
             f"Config `{check.config}`, results in `{check.output}` ({check.seconds:.0f} s).", "",
             "| layout | precision | verdict | first divergence | ratio | culprit | report |",
             "|---|---|---|---|---|---|---|"]
    lines += [_row(found, check.output) for found in check.layouts]
    text = "\n".join(lines) + "\n"
    for found in (r for r in check.layouts if r.outcome != "equivalent"):
        body = found.details if found.outcome == "not equivalent" else [f"log: {found.log}", *found.log_tail]
        section = "\n".join(["", f"### {found.name} ({found.precision}): {found.outcome}", "", _cell(found.message), "",
                             "```", *body, "```", ""])
        if len((text + section).encode()) > max_bytes - 200:
            return text + "\n(the remaining details are in the JSON and JUnit files)\n"
        text += section
    return text


def check_json(check: CheckResult) -> str:
    return strict_json.dumps({**asdict(check), "exit_code": check.exit_code}, indent=1)
