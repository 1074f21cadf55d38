"""Tensor: one tensor of both runs: verdict, shard map, per-rank error, |difference| image, histogram, worst elements."""

import json
from dataclasses import replace

import pandas as pd
import streamlit as st

from ttrace_dashboard import cells, figures
from ttrace_dashboard.ui import (bind_choice, go_to, legend, load_comparison,
                                 pair_caption, run_pair, show_in_url, stop_with, view_state, wrote_to_url)
from ttrace_core import api


state = view_state()
reference, candidate = run_pair(state)
frame = load_comparison(reference, candidate).frame
if not state.tensor:
    first = cells.first_divergence(frame)
    row = first if first is not None else frame.iloc[0]
    state = replace(state, tensor=row["tensor"], step=int(row["step"]), mb=int(row["micro_batch"]))
history = cells.history(frame, state.tensor)
if history.empty:
    stop_with(f"{state.tensor}: not in the comparison of {state.cand} against {state.ref}; pick a tensor on the heatmap")
instances = list(zip(history["step"].astype(int), history["micro_batch"].astype(int)))
current = (state.step, state.mb) if (state.step, state.mb) in instances else instances[0]

st.title(state.tensor)
pair_caption(state)
left, middle, right = st.columns([2, 1, 1])
# Keyed widgets bound to the URL (an `index=` alone lost every second pick).
bind_choice("tensor_instance", (state.tensor, state.step, state.mb), current, instances)
current = left.selectbox("Step / micro-batch", instances, key="tensor_instance",
                         format_func=lambda i: f"step {i[0]}" + ("" if i[1] < 0 else f" / mb {i[1]}"))
state = replace(state, step=current[0], mb=current[1])
row = frame[(frame["tensor"] == state.tensor) & (frame["step"] == state.step) & (frame["micro_batch"] == state.mb)].iloc[0]
if middle.button("Back to the heatmap", icon=":material/grid_on:"):
    go_to("heatmap", replace(state, tensor=None, rank=None))
target = cells.replay_target(row["module"], row["kind"], list(cells.module_rows(frame)["module"]))
if middle.button("Open in Localize", icon=":material/my_location:",
                 help=f"Replay {f'`{target}`' if target else 'the whole model'} with the reference's inputs"
                      + (f": `{row['module']}` receives this tensor from it" if target != row["module"] else "")):
    go_to("localize", replace(state, module=target or None, tensor=None, step=None, mb=None, rank=None))

(st.success if row["passed"] else st.error)(cells.verdict_banner(row))
if (catches := cells.detectable_text(row)) is not None:
    st.caption(catches)
legend()

try:
    view = api.tensor_view(reference, candidate, state.tensor, state.step, state.mb)
except api.TtraceError as error:
    stop_with(str(error))
ranks = [shard.rank for shard in view.shards]
bind_choice("tensor_rank", (state.tensor, state.step, state.mb, state.rank), state.rank if state.rank in ranks else None,
            [None, *ranks])
rank = right.selectbox("Highlight rank", [None, *ranks], key="tensor_rank",
                       format_func=lambda r: "none" if r is None else f"rank {r}")
state = replace(state, rank=rank)
show_in_url(state)
wrote_to_url("tensor_instance", (state.tensor, state.step, state.mb))
wrote_to_url("tensor_rank", (state.tensor, state.step, state.mb, state.rank))
tolerance = row["tolerance_rel"] if pd.notna(row["tolerance_rel"]) else None

maps, per_rank = st.columns([3, 2])
with maps:
    st.subheader("Shard map")
    st.caption(f"{view.dtype} {list(view.shape)}: which candidate rank holds which slice, coloured by that slice's error")
    st.plotly_chart(figures.shard_map_figure(view.shards, view.shape, tolerance, rank), key="shard_map")
    st.dataframe(pd.DataFrame([{"rank": s.rank, "coordinate": str(list(s.coordinate)), "placements": " ".join(s.placements),
                                "slice": " ".join(f"[{a}:{b})" for a, b in s.region), "error": s.error, "note": s.note}
                               for s in view.shards]), hide_index=True)
with per_rank:
    st.subheader("Per rank")
    st.caption("Each rank's shard (or replica) against the reference's same slice.")
    st.plotly_chart(figures.rank_error_figure(view.shards, tolerance), key="ranks")
    if (beyond := cells.ranks_beyond_text(view.shards, tolerance)) is not None:
        st.markdown(beyond)
    if view.replica_drift:
        st.warning(f"replicas on ranks {list(view.replica_drift.ranks)} differ by "
                   f"{view.replica_drift.relative_diff:.3g} relative")

image, histogram = st.columns(2)
with image:
    st.subheader("|difference|")
    st.plotly_chart(figures.difference_image_figure(view.image, view.image_block, view.image_view_shape), key="image")
with histogram:
    st.subheader("Relative error per element")
    st.caption(f"{view.num_exact} of {view.reference.size} elements are bitwise equal (not drawn)")
    st.plotly_chart(figures.histogram_figure(view.histogram_edges, view.histogram_counts, tolerance), key="histogram")

worst, derivation = st.columns([3, 2])
with worst:
    st.subheader("Worst elements")
    st.dataframe(pd.DataFrame(view.worst).assign(index=lambda d: d["index"].astype(str)) if view.worst else pd.DataFrame(),
                 hide_index=True)
with derivation:
    st.subheader("Tolerance")
    params = json.loads(row["tolerance_params"]) if isinstance(row["tolerance_params"], str) else {}
    st.markdown(f"method **{row['tolerance_method']}** · rel {tolerance if tolerance is None else f'{tolerance:.3g}'} · "
                f"abs {row['tolerance_abs']:.3g}\n\n{row['tolerance_source']}")
    if params:
        st.table(pd.DataFrame({"parameter": list(params), "value": [f"{v:.4g}" for v in params.values()]}))

st.subheader("Across steps and micro-batches")
st.plotly_chart(figures.history_figure(history, current), key="history")
