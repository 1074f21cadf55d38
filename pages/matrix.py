"""Layout matrix: every candidate layout of one reference x its modules, each cell the layout's worst
log10(error / tolerance) there; a click opens that pair's heatmap at that module."""

import streamlit as st

from ttrace_dashboard import figures, matrix, runs as pairing
from ttrace_dashboard.state import ROW_CHOICES, ViewState, query_from_state
from ttrace_dashboard.ui import (back_to_runs, bind_to_url, dashboard_root, go_to, matrix_cells, page, show_in_url,
                                 stop_with, table_unless_streamed, view_state, wrote_to_url)
from ttrace_core import api

# Past this many modules (in the largest layout) the matrix opens with one column per layer, as the heatmap does.
MODULE_COLUMNS_BY_DEFAULT = 200

st.title("Layout matrix")
state = view_state()
root = dashboard_root()
try:
    runs = api.find_runs(root)
    if state.ref:
        api.path_under_root(root, state.ref)  # one line for a path outside the root
except api.TtraceError as error:
    stop_with(str(error))
by_path = {run.path: run for run in runs}
references = [run.path for run in pairing.references(runs)]
if not references:
    stop_with(f"{root}: needs at least one reference run (record one with `ttrace record --out DIR -- ...`, "
              "`ttrace example ... --out DIR` or a Tracer)")
if state.ref and state.ref not in references:
    known = by_path.get(state.ref)
    back_to_runs(f"{state.ref}: {known.error}" if known is not None and known.error
                 else f"{state.ref}: not a reference run under {root}")

ref = state.ref or pairing.default_pair(runs, None, None)[0] or references[0]
left, middle, right = st.columns([2, 5, 1])
# Keyed widgets bound to the URL: a link sets them, and every later choice is the user's (bind_to_url).
bind_to_url("matrix_ref", state.ref, ref)
ref = left.selectbox("Reference", references, key="matrix_ref")
pool = pairing.layouts_of(runs, ref)
if not pool:
    show_in_url(ViewState(ref=ref))
    st.info(f"No candidate run under the root matches `{ref}` (same model and precision).")
    st.stop()
wanted = list(state.cands or ()) if ref == state.ref else []
for unknown in (path for path in wanted if path not in pool):
    st.warning(f"`{unknown}` is not a candidate of `{ref}` under the root: left out", icon=":material/warning:")
wanted = [path for path in wanted if path in pool] or pool
cands_key = f"matrix_cands:{ref}"  # one per reference: its candidates are the options
bind_to_url(cands_key, state.cands if ref == state.ref else None, wanted)
chosen = middle.multiselect("Candidate layouts", pool, key=cands_key,
                            format_func=lambda path: f"{path} ({by_path[path].layout})")
wrote_to_url("matrix_ref", ref)
wrote_to_url(cands_key, tuple(chosen) or None)
if not chosen:
    show_in_url(ViewState(ref=ref, rows=state.rows))
    st.info("Pick at least one candidate layout.")
    st.stop()

results, pending = {}, []
for cand in chosen:
    try:
        found = table_unless_streamed(api.path_under_root(root, ref), api.path_under_root(root, cand))
    except api.TtraceError as error:
        st.error(f"`{cand}`: {error}", icon=":material/error:")
        continue
    if found is None:
        pending.append(cand)
    else:
        results[cand] = found

num_modules = max((result.frame["module"].nunique() for result in results.values()), default=0)
bind_to_url("matrix_rows", state.rows,
            state.rows or ("layers" if num_modules > MODULE_COLUMNS_BY_DEFAULT else "modules"))
rows_choice = right.selectbox("Columns", ROW_CHOICES, key="matrix_rows",
                              help=f"one column per module (up to {num_modules}), or per layer (its worst module)")
state = ViewState(ref=ref, cands=tuple(chosen), rows=rows_choice)
show_in_url(state)
wrote_to_url("matrix_rows", rows_choice)

cells = matrix_cells(results, rows_choice)
diverging = sorted(set(cells.loc[cells["first_divergence"].astype(bool), "layout"]))
st.caption(f"{len(diverging)} of {len(results)} compared layouts diverge. Colour: each layout's worst "
           "log10(error / tolerance) over the module's tensors up to the layout's first divergence (all steps, "
           "micro-batches, kinds); 0 is the pass line. The yellow outline is each layout's first divergence; faded cells "
           "are modules that ran only after it (they inherit it). Click a cell to open that pair's heatmap there.")
layouts = [cand for cand in chosen if cand in results or cand in pending]
event = st.plotly_chart(figures.matrix_figure(cells, layouts, matrix.matrix_columns(cells), pending), key="matrix",
                        on_select="rerun", selection_mode="points", config={"displayModeBar": False})
clicked = matrix.clicked_cell(event)
if clicked is not None:
    go_to("heatmap", ViewState(ref=ref, cand=clicked[0], module=clicked[1], rows=rows_choice))

for cand in pending:
    st.page_link(page("heatmap"), label=f"{cand}: not compared yet, open its heatmap (it draws while comparing)",
                 icon=":material/grid_on:", query_params=query_from_state(ViewState(ref=ref, cand=cand)))
