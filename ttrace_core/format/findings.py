"""Findings in the trace store: what the tracer could not record, and why.

A recording that meets a tensor it cannot map (a declared placement that does not fit it, a layout
no one can infer) or a failure of its own leaves that tensor out and keeps a `schema.Finding`
instead, so the training run goes on. Each step file holds its findings in the dataset FINDINGS,
one JSON record per line (writer.py `RunWriter.add_finding`); a partial step file keeps those made
before the step stopped. The reader collects them (`RunReader.findings`), `ttrace inspect` lists
them and a comparison counts the tensors they left out as not compared.
"""

from __future__ import annotations

import h5py

from ttrace_core.format.containment import refuse_external_storage
from ttrace_core.format.datasets import read_bytes_dataset
from ttrace_core.format.records import finding_from_json
from ttrace_core.format.schema import Finding

FINDINGS = "findings"
"""Step-file dataset: the step's findings, one JSON record per line, as uint8."""


def findings_in_file(handle: h5py.File, where: str) -> list[Finding]:
    """The findings one step file holds (none when it has no FINDINGS dataset)."""
    if FINDINGS not in handle:
        return []
    dataset = handle[FINDINGS]
    refuse_external_storage(dataset.id, f"{where}:{FINDINGS}")
    text = read_bytes_dataset(dataset, f"{where}:{FINDINGS}", "re-record this rank")
    return [finding_from_json(line, f"{where}:{FINDINGS} line {number}")
            for number, line in enumerate(text.splitlines(), start=1) if line.strip()]


def finding_lines(findings: list[Finding]) -> list[str]:
    """One line per distinct finding, in the order they were first made, with where it recurred."""
    groups: dict[str, list[Finding]] = {}
    for finding in findings:
        groups.setdefault(finding.message, []).append(finding)
    return [f"{message} ({_extent(group)})" for message, group in groups.items()]


def _extent(group: list[Finding]) -> str:
    ranks, steps = sorted({f.rank for f in group}), sorted({f.step for f in group})
    return f"{len(group)} time{'s' if len(group) > 1 else ''}: ranks {ranks}, steps {steps}"
