"""The shareable report: one self-contained HTML file of a comparison (render stage, beside the pages).

Verdict, headroom by tensor family, heatmap, timeline, first divergence, localization verdicts (when a
whole-model replay has finished), the worst tensors, tolerance provenance and both runs' metadata.
Plotly's JavaScript is embedded once; the file references nothing outside itself, so it opens from
disk, offline, with no Python.
`ttrace report REF CAND -o report.html` and the dashboard's "Export report" button both call
`report_html`.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import pandas as pd
import plotly.offline

from ttrace_dashboard import cells, figures, verdicts
from ttrace_dashboard.runs import metadata_rows
from ttrace_core import api

WORST_SHOWN = 20
_STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
.fail{background:#fde0e0;padding:.6em 1em}.pass{background:#e0f5e0;padding:.6em 1em}.warn{background:#fff3cd;padding:.6em 1em}
h2{margin-top:1.6em}code{background:#f4f4f4;padding:0 3px}"""


def _table(frame: pd.DataFrame) -> str:
    return frame.to_html(index=False, border=0, na_rep="-", float_format=lambda v: f"{v:.3g}", escape=True)


def _figure(figure) -> str:
    # The figure builders leave backgrounds and text colours to the dashboard's theme; the report is a light page.
    figure.update_layout(template="plotly_white")
    return figure.to_html(full_html=False, include_plotlyjs=False, config={"displayModeBar": False})


def _verdict_section(provenance: dict) -> str:
    level, text = api.verdict_of(provenance).banner()
    return f'<p class="{ {"success": "pass", "error": "fail"}.get(level, "warn") }">{html.escape(text)}</p>'


def _headroom_section(provenance: dict) -> str:
    """Per tensor kind, the smallest relative error the verdict could have caught (the CLI prints the same table)."""
    headroom = api.verdict_of(provenance).headroom
    if not headroom:
        return "<p>No tensor was compared element-wise, so no error size is bounded.</p>"
    rows = pd.DataFrame([{"kind": h.kind, "tensors": h.num_tensors, "median": h.median, "largest": h.largest}
                         for h in headroom])
    return ("<p>The smallest relative error ||actual - expected|| / ||expected|| the verdict catches on each tensor "
            "family: the median over its tensors, and the largest (an error up to it could pass on one of them).</p>"
            + _table(rows))


def _localization_section(reference: Path, candidate: Path, settings: api.CompareSettings) -> str:
    job = api.replay_job(reference, candidate, settings=settings)
    result = api.localization(job) if job is not None else None
    if result is None:
        return "<p>No whole-model replay has finished for this pair (<code>ttrace localize</code> runs one).</p>"
    level, line = verdicts.summary(result)
    rows = verdicts.verdict_rows(result)
    shown = rows[rows["verdict"] != verdicts.VERDICT_MARKS["clean"]].drop(columns=["module"])
    return (f'<p class="{ {"success": "pass", "error": "fail"}.get(level, "warn") }">{html.escape(line)}</p>'
            f"<p>reproduce: <code>{html.escape(result.command)}</code></p>" + _table(shown))


def report_html(reference: str | Path, candidate: str | Path, settings: api.CompareSettings | None = None) -> str:
    reference, candidate = Path(reference).resolve(), Path(candidate).resolve()
    settings = settings or api.CompareSettings()
    result = api.comparison_table(reference, candidate, settings)
    frame, provenance = result.frame, result.provenance
    first = cells.first_divergence(frame)
    step = int(first["step"]) if first is not None else int(frame["step"].min())
    marked = (first["module"], first["kind"]) if first is not None else None
    view_cells = cells.heatmap_cells(frame, step, "all")
    if first is not None:
        view_cells = cells.pointing_at_first(view_cells, first, first["module"])
    heatmap = figures.heatmap_figure(view_cells, cells.module_rows(frame), marked)
    timeline = figures.timeline_figure(cells.timeline_points(frame, step), int(first["order"]) if first is not None else None)
    worst = frame.sort_values("ratio", ascending=False, na_position="first")
    worst = worst[~worst["passed"]].head(WORST_SHOWN) if not frame["passed"].all() else worst.head(WORST_SHOWN)
    worst_columns = ["tensor", "step", "micro_batch", "status", "error", "tolerance_rel", "tolerance_source", "ratio",
                     "value_ratio", "drift_ratio", "max_abs_diff", "max_abs_index"]
    methods = frame.groupby(["tolerance_method"], dropna=False).size().rename("tensors").reset_index()
    runs = pd.DataFrame({"reference": metadata_rows(api.run_info(reference)),
                         "candidate": metadata_rows(api.run_info(candidate))}).reset_index(names="")
    body = [
        f"<h1>ttrace report</h1><p>reference <code>{html.escape(str(reference))}</code><br>"
        f"candidate <code>{html.escape(str(candidate))}</code></p>", _verdict_section(provenance),
        "<h2>Headroom by tensor family</h2>", _headroom_section(provenance),
        f"<h2>Error heatmap (step {step}, worst over micro-batches)</h2>",
        "<p>Colour: log10(error / tolerance); 0 is the pass line; the yellow outline is the first divergence.</p>",
        _figure(heatmap), "<h2>Timeline</h2>", _figure(timeline),
        "<h2>Localization</h2>", _localization_section(reference, candidate, settings),
        f"<h2>Worst tensors</h2>", _table(worst[worst_columns]),
        "<h2>Tolerances</h2>", f"<p>provider: {html.escape(provenance['tolerance_provider'])}; settings "
        f"<code>{html.escape(json.dumps(provenance['settings']))}</code></p>", _table(methods),
        "<h2>Runs</h2>", _table(runs),
        f"<p><small>ttrace {html.escape(provenance['ttrace_version'])}, table {html.escape(result.path.name)}, "
        f"created {html.escape(provenance['created'])}</small></p>",
    ]
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>ttrace report</title><style>{_STYLE}</style>"
            f"<script type='text/javascript'>{plotly.offline.get_plotlyjs()}</script></head><body>"
            + "\n".join(body) + "</body></html>")


def write_report(reference: str | Path, candidate: str | Path, out: str | Path,
                 settings: api.CompareSettings | None = None) -> Path:
    """`ttrace report -o` (registered as the `html` writer of the `ttrace.report_writers` entry point)."""
    out = Path(out)
    out.write_text(report_html(reference, candidate, settings), encoding="utf-8")
    return out
