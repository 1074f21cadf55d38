"""Runs: every run under the root; pick a reference, a candidate and (for another implementation) a correspondence
map, see their metadata and the verdict."""

import pandas as pd
import streamlit as st

from ttrace_dashboard import cells, runs as pairing
from ttrace_dashboard.state import ViewState, query_from_state
from ttrace_dashboard.ui import (bind_choice, correspondence, dashboard_root, legend, load_comparison, page, run_pair,
                                 show_in_url, stop_with, view_state, wrote_to_url)
from ttrace_core import api


st.title("Runs")
state = view_state()
try:
    runs = api.find_runs(dashboard_root())
except api.TtraceError as error:
    stop_with(str(error))
for broken in (run for run in runs if run.error):
    st.warning(f"`{broken.path}` cannot be used: {broken.error}", icon=":material/warning:")
if not pairing.references(runs) or not pairing.candidates(runs):
    stop_with(f"{dashboard_root()}: needs at least one reference run and one candidate run "
              "(record them with `ttrace record --out DIR -- ...`, `ttrace example ... --out DIR` or a Tracer)")

ref_paths = [r.path for r in pairing.references(runs)]
cand_paths = [c.path for c in pairing.candidates(runs)]
# A link's pair that cannot be shown is said, never silently replaced by the default pair.
for problem in pairing.link_problems(runs, state.ref, state.cand):
    st.warning(problem, icon=":material/link_off:")
ref, cand = pairing.default_pair(runs, state.ref, state.cand)
by_path = {run.path: run for run in runs}


def follow_candidate() -> None:
    # A new candidate brings the reference of its model and precision (a bf16 reference cannot judge an fp32
    # candidate without an estimate for it); the user can still pick another one afterwards.
    matched = pairing.matching_reference(runs, by_path[st.session_state["runs_cand"]])
    if matched is not None:
        st.session_state["runs_ref"] = matched.path


# Keyed widgets bound to the URL: a link sets them, every later pick is the user's (an `index=` alone
# was reread only when the widget changed identity, and lost every second pick).
bind_choice("runs_ref", state.ref, ref if ref in ref_paths else ref_paths[0], ref_paths)
bind_choice("runs_cand", state.cand, cand, cand_paths)
map_choices = pairing.map_options(api.shipped_map_names(), state.map)
bind_choice("runs_map", state.map, state.map or pairing.NO_MAP, map_choices)
left, middle, right = st.columns(3)
chosen_ref = left.selectbox("Reference", ref_paths, key="runs_ref")
chosen_cand = middle.selectbox("Candidate", cand_paths, key="runs_cand", on_change=follow_candidate)
chosen_map = right.selectbox("Correspondence map", map_choices, key="runs_map", format_func=pairing.map_label,
                             help="Another implementation as the reference (docs/porting.md): the map relates the two "
                                  "tensor by tensor")
if (chosen_ref, chosen_cand, chosen_map or None) != (state.ref, state.cand, state.map):
    state = ViewState(ref=chosen_ref, cand=chosen_cand, map=chosen_map or None)
show_in_url(state)
wrote_to_url("runs_ref", state.ref)
wrote_to_url("runs_cand", state.cand)
wrote_to_url("runs_map", state.map)

table = pd.DataFrame({name: pairing.metadata_rows(by_path[path]) for name, path in
                      (("reference", state.ref), ("candidate", state.cand))})
st.table(table)  # a static table wraps its cells: the versions and the model config are read whole
if (better := pairing.better_reference(runs, by_path[state.ref], by_path[state.cand])) is not None:
    st.info(f"The candidate computes in {by_path[state.cand].precision}, the reference in "
            f"{by_path[state.ref].precision}: `{better.path}` is the reference of the same model in "
            f"{better.precision}.", icon=":material/info:")
    st.page_link(page("runs"), label=f"Compare against {better.path}", icon=":material/swap_horiz:",
                 query_params=query_from_state(ViewState(ref=better.path, cand=state.cand, map=state.map)))
if not state.map and (fitting := pairing.suggested_maps(by_path[state.ref], by_path[state.cand])):
    st.info(pairing.suggestion_text(by_path[state.ref], fitting), icon=":material/lightbulb:")
    st.page_link(page("runs"), label=f"Compare through {fitting[0]}", icon=":material/compare_arrows:",
                 query_params=query_from_state(ViewState(ref=state.ref, cand=state.cand, map=fitting[0])))


def verdict_so_far(rows: "api.StreamedRows") -> None:
    first = cells.first_divergence(rows.frame)
    if first is not None:
        st.error(f"First divergence so far: `{first['tensor']}` (step {first['step']}): {first['message']}",
                 icon=":material/cancel:")
    st.page_link(page("heatmap"), label="Open the heatmap (it draws while comparing)", icon=":material/grid_on:",
                 query_params=query_from_state(state))


reference, candidate = run_pair(state)
if (loaded := correspondence(state)) is not None:
    st.info(pairing.map_text(loaded.name, loaded.spec.reference, loaded.spec.candidate,
                             reference.relative_to(dashboard_root()).as_posix()), icon=":material/compare_arrows:")
result = load_comparison(reference, candidate, partial_view=verdict_so_far)
provenance = result.provenance
verdict = api.verdict_of(provenance)
level, text = verdict.banner()
ICONS = {"success": ":material/check_circle:", "warning": ":material/warning:", "error": ":material/cancel:"}
getattr(st, level)(text, icon=ICONS[level])
if unmapped := pairing.unmapped_lines(verdict.coverage):
    st.markdown("\n".join(unmapped))
for note in provenance.get("notes", []):
    st.warning(note)
st.caption(f"tolerances: {provenance['tolerance_provider']} · table {result.path.name} "
           f"({'cached' if result.cached else 'computed'}, {provenance['seconds']} s to compute)")
st.caption(cells.next_step_caption(cells.first_divergence(result.frame) is not None))
legend()
# A link, not a button: the browser switches page at once instead of first rerunning this one.
st.page_link(page("heatmap"), label="Open the heatmap", icon=":material/grid_on:", query_params=query_from_state(state))
if not state.map:  # the layout matrix compares the layouts of one code: a reference of another has none
    st.page_link(page("matrix"), label="Every layout of this reference (layout matrix)", icon=":material/table_chart:",
                 query_params=query_from_state(ViewState(ref=state.ref)))
