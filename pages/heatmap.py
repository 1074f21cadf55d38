"""Heatmap: every module x tensor kind of one step, coloured by log10(error / tolerance); a click opens the tensor."""

from dataclasses import replace

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from ttrace_dashboard import cells, step_view
from ttrace_dashboard.report import report_html
from ttrace_dashboard.state import ALL_MICRO_BATCHES, ROW_CHOICES, default_rows, view_from_click
from ttrace_dashboard.ui import (bind_choice, go_to, legend, load_comparison, pair_caption, run_pair, show_in_url,
                                 table_identity, view_state, wrote_to_url)
from ttrace_core import api

BANNER_ICONS = {"success": ":material/check_circle:", "warning": ":material/warning:", "error": ":material/cancel:"}


@st.cache_resource(max_entries=16, show_spinner=False)
def cached_step_view(table: tuple[str, int], step: int, mb, rows_choice: str, focus: str | None,
                     _frame: pd.DataFrame) -> step_view.StepView:
    # `table` (path, mtime) names `_frame`: a recomputed table is another entry.
    return step_view.step_view(_frame, step, mb, rows_choice, focus)


@st.cache_resource(max_entries=16, show_spinner=False)
def cached_timeline(table: tuple[str, int], step: int, _frame: pd.DataFrame) -> go.Figure:
    return step_view.step_timeline(_frame, step)


def divergence_banner(first) -> None:
    mb_text = "" if first["micro_batch"] < 0 else f" mb {first['micro_batch']}"
    st.error(f"First divergence: `{first['tensor']}` (step {first['step']}{mb_text}): {first['message']}",
             icon=":material/cancel:")


def heatmap_so_far(rows: "api.StreamedRows") -> None:
    # A large pair's first comparison, while it runs: the rows compared so far are final, and the
    # first failing one among them is the first divergence (rows arrive in execution order).
    frame = rows.frame
    first = cells.first_divergence(frame)
    if first is not None:
        divergence_banner(first)
    else:
        st.info(f"No divergence in the first {len(frame)} tensors.", icon=":material/hourglass_top:")
    step = int(first["step"]) if first is not None else int(frame["step"].min())
    rows_choice = state.rows or default_rows(frame["module"].nunique())
    st.caption(f"Step {step}, the tensors compared so far. Colour: log10(error / tolerance), 0 is the pass line.")
    # Redrawn when the rows grew by a quarter: each poll drawing every row again took the cores the comparison needs.
    drawn_key = f"_heatmap_so_far:{state.ref}:{state.cand}:{state.map}"
    drawn = st.session_state.get(drawn_key)
    if drawn is None or len(frame) >= 1.25 * drawn[0] or (first is not None) != drawn[1]:
        focus = cells.focus_row(state.module, rows_choice == "layers")
        _, figure, _ = step_view.step_heatmap(frame, step, ALL_MICRO_BATCHES, rows_choice, focus)
        drawn = st.session_state[drawn_key] = (len(frame), first is not None, figure)
    st.plotly_chart(drawn[2], key="heatmap_so_far", config={"displayModeBar": False}, width="content")


state = view_state()
reference, candidate = run_pair(state)
st.title("Error heatmap")
pair_caption(state)
result = load_comparison(reference, candidate, partial_view=heatmap_so_far)
frame = result.frame
first = cells.first_divergence(frame)

steps = sorted(frame["step"].unique().tolist())
step = state.step if state.step in steps else (int(first["step"]) if first is not None else steps[0])
num_modules = frame["module"].nunique()
rows_choice = state.rows or default_rows(num_modules)
left, middle, rows_box, right = st.columns([1, 1, 1, 3])
# Keyed widgets bound to the URL (an `index=` alone lost every second choice).
bind_choice("heatmap_step", state.step, step, steps)
step = left.selectbox("Step", steps, key="heatmap_step")
micro_batches = sorted(m for m in frame.loc[frame["step"] == step, "micro_batch"].unique().tolist() if m >= 0)
mb_options = [ALL_MICRO_BATCHES, *micro_batches]
bind_choice("heatmap_mb", state.mb, state.mb if state.mb in mb_options else ALL_MICRO_BATCHES, mb_options)
mb = middle.selectbox("Micro-batch", mb_options, key="heatmap_mb",
                      format_func=lambda m: "all (worst)" if m == ALL_MICRO_BATCHES else str(m))
bind_choice("heatmap_rows", state.rows, rows_choice, list(ROW_CHOICES))
rows_choice = rows_box.selectbox("Rows", ROW_CHOICES, key="heatmap_rows",
                                 help=f"one row per module ({num_modules}), or per layer (its worst module)")
state = replace(state, step=int(step), mb=mb, tensor=None, rank=None, rows=rows_choice)
show_in_url(state)
for key, value in (("heatmap_step", state.step), ("heatmap_mb", state.mb), ("heatmap_rows", state.rows)):
    wrote_to_url(key, value)

summary = api.verdict_of(result.provenance)
if first is None or summary.verdict == "refused":  # passing rows, yet the evidence may be incomplete or refused
    level, text = summary.banner()
    getattr(st, level)(text, icon=BANNER_ICONS[level])
else:
    divergence_banner(first)

st.download_button("Export report", data=lambda: report_html(reference, candidate), file_name="ttrace-report.html",
                   mime="text/html", icon=":material/download:",
                   help="one self-contained HTML file: heatmap, timeline, verdicts, worst tensors; opens offline")

focus = cells.focus_row(state.module, rows_choice == "layers")
view = cached_step_view(table_identity(result), int(step), mb, rows_choice, focus, frame)
with right:
    picked = st.selectbox("Go to a tensor (failures first)", view.choices, index=None, placeholder="type to search",
                          format_func=lambda c: f"{c[0]}" + ("" if c[2] < 0 else f" · mb {c[2]}"))
if picked is not None:
    go_to("tensor", replace(state, tensor=picked[0], step=picked[1], mb=picked[2], rows=None))

st.caption("Colour: log10(error / tolerance), 0 is the pass line. The yellow outline is the first divergence"
           + (f"; the framed row is `{focus}`, the module the link points at" if focus in set(view.rows["module"]) else "")
           + ". Click a cell to open its tensor.")
legend()
# At the figure's own width (its column pitch keeps the headers apart), narrower only on a narrower page.
event = st.plotly_chart(view.heatmap, key="heatmap", on_select="rerun", selection_mode="points",
                        config={"displayModeBar": False}, width="content")
clicked = view_from_click(event, state)
if clicked is not None:
    go_to("tensor", clicked)

with st.container(horizontal=True):
    # The first divergence's own module, or for a tensor it receives (an input) the module around it (replay_target).
    start = None if first is None else cells.replay_target(first["module"], first["kind"], view.suspects)
    default = cells.replay_default(view.suspects, state.module, start)
    target = st.selectbox("Replay a module with the reference's inputs", view.suspects, index=default)
    if st.button("Open in Localize", icon=":material/my_location:"):
        go_to("localize", replace(state, module=target, step=None, mb=None, rows=None))

# Drawn on request: a second chart of every tensor of the step cost the browser about 0.5 s on each load of a
# 48-layer pair's heatmap (benchmarks/results/dashboard.md); the open state is kept for the session.
timeline_box = st.expander("Timeline: every tensor of the step in execution order", icon=":material/timeline:",
                           key="heatmap_timeline", on_change="rerun")
if timeline_box.open:
    with timeline_box:
        st.caption("The initial parameter values (when the run recorded them), forward, backward, reduced gradients, "
                   "updated parameters; one point per module and tensor kind, its worst tensor.")
        timeline = st.plotly_chart(cached_timeline(table_identity(result), int(step), frame), key="timeline",
                                   on_select="rerun", selection_mode="points", config={"displayModeBar": False})
    clicked = view_from_click(timeline, state)
    if clicked is not None:
        go_to("tensor", clicked)

drifting = frame[(frame["step"] == step) & (frame["drift_ratio"].fillna(0) > 1)]
if not drifting.empty:
    st.subheader("Replica drift")
    st.caption("Replicated tensors whose copies differ between candidate ranks (ratio against one rounding).")
    st.dataframe(drifting[["tensor", "micro_batch", "drift_ranks", "drift_relative_diff", "drift_ratio"]], hide_index=True)
