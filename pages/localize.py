"""Localize: replay the candidate with the reference's inputs; each module introduces, inherits or is clean."""

from dataclasses import replace

import streamlit as st

from ttrace_dashboard import cells, verdicts
from ttrace_dashboard.report import report_html
from ttrace_dashboard.ui import (SETTINGS, bind_choice, go_to, legend, load_comparison,
                                 pair_caption, run_pair, show_in_url, stop_with, view_state, wrote_to_url)
from ttrace_core import api

WHOLE_MODEL = ""

state = view_state()
reference, candidate = run_pair(state)
st.title("Localize")
pair_caption(state)
frame = load_comparison(reference, candidate).frame
# The loss and the gradient clipping are no modules: a replay cannot feed them the reference's inputs.
modules = [WHOLE_MODEL, *(m for m in cells.module_rows(frame)["module"] if m not in api.PSEUDO_MODULES)]
module = state.module if state.module in modules else WHOLE_MODEL
if state.module and state.module not in modules and api.owner_of(state.module) in modules:
    module = api.owner_of(state.module)  # a parameter's name: replay the module that owns it
bind_choice("localize_module", state.module, module, modules)  # keyed and bound to the URL: no pick is lost
module = st.selectbox("Replay target", modules, key="localize_module",
                      format_func=lambda m: "the whole model" if m == WHOLE_MODEL else m)
state = replace(state, module=module or None, tensor=None, rank=None)
show_in_url(state)
wrote_to_url("localize_module", state.module)
st.caption("The replay relaunches the candidate from its manifest with every traced module of the target fed the "
           "reference's inputs and output gradients. A module whose own outputs still fail introduces the error; "
           "one that fails only before rewriting inherits it.")
legend()

job = api.replay_job(reference, candidate, state.module, SETTINGS)
# Not in a narrow column: there the label was cut ("Replay with referen...").
if st.button("Replay with reference inputs", type="primary", icon=":material/play_arrow:", width="content",
             disabled=job is not None and not job.status().done):
    try:
        job = api.submit_replay(reference, candidate, state.module, rerun=job is not None and job.status().done,
                                 settings=SETTINGS)
    except api.TtraceError as error:
        stop_with(str(error))
if job is None:
    st.info("No replay of this target yet.")
    st.stop()


@st.fragment(run_every=1.0)
def follow(job: api.Job) -> None:
    status = job.status()
    if status.done:
        st.rerun()  # the whole page draws the verdict
    st.progress(verdicts.progress_fraction(status.progress),
                text=verdicts.progress_text(status.progress or status.message, status.seconds))
    st.code("\n".join(job.log_tail(12)) or "(no output yet)", language=None)
    if st.button("Cancel", icon=":material/stop:"):
        job.cancel()


status = job.status()
if not status.done:
    follow(job)
    st.stop()
if status.state != "complete":
    st.error(f"The replay {status.state.replace('_', ' ')}: {status.message}", icon=":material/error:")
    st.code("\n".join(job.log_tail(15)), language=None)
    st.stop()

try:
    result = api.localization(job)
except api.TtraceError as error:
    stop_with(str(error))
level, line = verdicts.summary(result)
getattr(st, level)(line)
scope = {"module alone": "only this module ran", "whole model": "the whole model ran"}.get(result.replay_scope,
                                                                                       result.replay_scope)
st.caption(f"replay {job.directory.name} · {scope} · {status.seconds or 0:.0f} s · reproduce: `{result.command}`")
if result.reproduction:
    reproduction = result.reproduction
    with st.expander(f"Reproduction check: {reproduction['num_checked']} tensors computed from exact inputs",
                     expanded=result.reproduced is False):
        st.write("mismatches:", reproduction["mismatches"] or "none")
        st.write("environment differences (recorded -> replay):", reproduction["differences"] or "none")
for finding in result.sync:
    st.error(f"The {finding.reduction} gradient reduction introduces the error ({finding.bug_class}: {finding.detail}) "
             f"in {len(finding.params)} parameter(s): {', '.join(finding.params[:6])}")
rows = verdicts.verdict_rows(result)
if not rows.empty:
    st.subheader("Modules")
    st.dataframe(rows.drop(columns=["fqn"]), hide_index=True, height=min(600, 35 * (len(rows) + 1) + 3))
for target in verdicts.bisect_targets(result, state.module):
    if st.button(f"Bisect further: replay {target} alone", key=f"bisect-{target}"):
        go_to("localize", replace(state, module=target))
for note in result.notes:
    st.caption(note)
st.download_button("Export report", data=lambda: report_html(reference, candidate), file_name="ttrace-report.html",
                   mime="text/html", icon=":material/download:")
