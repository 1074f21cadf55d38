"""Streamlit helpers shared by the pages: the root, the URL state, page switches, loading through the api.

Every failure a user can cause (a refused path, an unreadable trace) is shown as one `st.error`
line, the same text the CLI prints; the page then stops, and the other pages stay usable.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import streamlit as st

from ttrace_dashboard import cells, matrix
from ttrace_dashboard.state import ViewState, query_from_state, state_from_query
from ttrace_core import api
from ttrace_core.api import ROOT_ENV, TtraceError

PAGES_DIR = Path(next(iter(importlib.util.find_spec("ttrace_dashboard.views").submodule_search_locations)))
"""The page scripts: pages/ in the repository, ttrace_dashboard/views installed (pyproject.toml maps them; a
`pages/` beside the entry script would be Streamlit's legacy multipage layout)."""
SETTINGS = api.CompareSettings()
"""How the dashboard judges tensors; the same object reaches the comparison, the replays and the report."""
POLL_S = 0.5
"""How often a page showing a streamed comparison reads its rows again (only the chunks written since)."""
PAGES = {  # url path -> (script, title, icon)
    "runs": ("runs.py", "Runs", ":material/folder_open:"),
    "matrix": ("matrix.py", "Layout matrix", ":material/table_chart:"),
    "heatmap": ("heatmap.py", "Heatmap", ":material/grid_on:"),
    "tensor": ("tensor.py", "Tensor", ":material/biotech:"),
    "localize": ("localize.py", "Localize", ":material/my_location:"),
}


def page(name: str) -> st.Page:
    script, title, icon = PAGES[name]
    return st.Page(PAGES_DIR / script, title=title, icon=icon, url_path=name)


def _forward_to_runs() -> None:
    go_to("runs", view_state())


def navigation_pages() -> list[st.Page]:
    """Every page, plus a hidden default one: Streamlit serves the default page at "/" only, so the
    app root forwards to /runs (keeping the URL's state) and every page keeps its own path."""
    home = st.Page(_forward_to_runs, title="ttrace", url_path="home", default=True, visibility="hidden")
    return [home, *(page(name) for name in PAGES)]


def sidebar_links(slot) -> None:
    """The sidebar's page links, each carrying the URL's pair and map (the matrix its reference), so a pair picked
    on Runs travels with every link. Streamlit's own navigation links drop the query parameters, so the
    app hides them (`position="hidden"`) and draws these in `slot` (an `st.sidebar.empty()`)."""
    st.session_state["_sidebar_slot"] = slot  # for `show_in_url`, which redraws the links with the new pair
    state = view_state()
    with slot.container():
        for name in PAGES:
            # The layout matrix compares every layout of one reference by the same code: no map there.
            pair = ViewState(ref=state.ref) if name == "matrix" else ViewState(ref=state.ref, cand=state.cand, map=state.map)
            st.page_link(page(name), query_params=query_from_state(pair))


CHART_CHUNK = "PlotlyChart.*.js"
"""Streamlit's frontend loads plotly.js (its PlotlyChart chunk, 4.7 MB in 1.67) only when a page first draws a
chart; a browser then takes about 0.6 s to fetch and compile it (benchmarks/results/dashboard.md)."""


@functools.cache
def _chart_chunk() -> str | None:
    """The file name of Streamlit's plotly.js chunk (content-hashed), None when this Streamlit has none."""
    found = sorted((Path(st.__file__).parent / "static" / "static" / "js").glob(CHART_CHUNK))
    return found[0].name if len(found) == 1 else None


def preload_charts() -> None:
    """Load Streamlit's plotly.js chunk while the page shows, so that the first page with a chart (the heatmap,
    after Runs) draws without waiting for it. A module is loaded once per URL, and the frontend's own import
    asks for the same URL, so it finds it loaded. Nothing when this Streamlit's chunk is not found (another
    version's layout): pages then draw as before, only later."""
    chunk = _chart_chunk()
    if chunk is not None:
        st.html(f"<script>import('./static/js/{chunk}').catch(() => {{}})</script>", unsafe_allow_javascript=True)


def dashboard_root() -> Path:
    return Path(os.environ.get(ROOT_ENV, ".")).resolve()


def view_state() -> ViewState:
    return state_from_query(st.query_params.to_dict())


def show_in_url(state: ViewState) -> None:
    """Write the whole state into the URL, so that a copied link reopens this exact view."""
    wanted = query_from_state(state)
    if st.query_params.to_dict() != wanted:
        st.query_params.from_dict(wanted)
        if (slot := st.session_state.get("_sidebar_slot")) is not None:
            sidebar_links(slot)  # now, not after the page: a page that stops later must not keep the old pair's links


def bind_to_url(key: str, url_value, value) -> None:
    """Give the keyed widget `key` the value `value` (read from the URL's `url_value`) when the widget is new or
    the URL changed since this session wrote it (a shared link, a page switch); otherwise the widget keeps the
    user's choice. (A widget's `index`/`default` alone is reread only when the widget's identity changes, which
    lost every second change of a multiselect.) Create the widget with `key` and without a default."""
    written = f"_url:{key}"
    if key not in st.session_state or st.session_state.get(written) != url_value:
        st.session_state[key] = value
        st.session_state[written] = url_value


def bind_choice(key: str, url_value, value, options: list) -> None:
    """`bind_to_url` for a selectbox over `options`: a kept choice that is not among them (another pair,
    another step's micro-batches) gives way to `value`."""
    bind_to_url(key, url_value, value)
    if st.session_state[key] not in options:
        st.session_state[key] = value


def wrote_to_url(key: str, url_value) -> None:
    """Record what the URL now says for the widget `key` (after `show_in_url`), for `bind_to_url`."""
    st.session_state[f"_url:{key}"] = url_value


def go_to(name: str, state: ViewState) -> None:
    st.switch_page(page(name), query_params=query_from_state(state))


def stop_with(message: str) -> None:
    st.error(message, icon=":material/error:")
    st.stop()


def back_to_runs(message: str) -> None:
    """A link that cannot be shown: say why in one line, offer the way back to Runs, stop the page."""
    st.error(message, icon=":material/link_off:")
    st.page_link(page("runs"), label="Pick a pair on Runs", icon=":material/folder_open:")
    st.stop()


def link_problem(state: ViewState) -> str | None:
    """Why the link's pair cannot be shown, in the dashboard's words (not the CLI's), or None."""
    for name, relative in (("ref", state.ref), ("cand", state.cand)):
        try:
            path = api.path_under_root(dashboard_root(), relative)
        except TtraceError as error:
            return f"The link's {name}= {error}"
        if not (path / "manifest.json").is_file():
            return f"The link's {name}=`{relative}` is not a run under `{dashboard_root()}`."
    problem = api.pair_problem(dashboard_root() / state.ref, dashboard_root() / state.cand)
    return None if problem is None else f"The link's pair cannot be compared: {problem}."


def run_pair(state: ViewState) -> tuple[Path, Path]:
    """The reference and candidate directories of the URL, confined to the root; stops the page otherwise. With a
    map in the URL the reference is its mapped copy (made the first time, `ttrace compare --map` does the same),
    so every page compares, shows and replays against it unchanged."""
    if not state.ref or not state.cand:
        st.info("Pick a reference and a candidate on the Runs page first.")
        st.page_link(page("runs"), label="Go to Runs", icon=":material/folder_open:")
        st.stop()
    if (problem := link_problem(state)) is not None:
        back_to_runs(problem)
    reference = api.path_under_root(dashboard_root(), state.ref)
    if state.map:
        reference = _mapped_reference(reference, correspondence(state))
    return reference, api.path_under_root(dashboard_root(), state.cand)


def correspondence(state: ViewState):
    """The URL's correspondence map (an `api.correspondence_map`), None without one: a shipped map by name, else a
    .toml file under the root (confined as run paths are). A map that cannot be used stops the page with its line."""
    if not state.map:
        return None
    try:
        if state.map in api.shipped_map_names():
            return api.correspondence_map(state.map)
        path = api.path_under_root(dashboard_root(), state.map)
        if path.suffix != ".toml" or not path.is_file():
            raise TtraceError(f"map={state.map}: neither a shipped map ({', '.join(api.shipped_map_names())}) nor a "
                              f".toml map file under the dashboard root {dashboard_root()}")
        return api.correspondence_map(path)
    except TtraceError as error:
        stop_with(str(error))


def _mapped_reference(reference: Path, loaded) -> Path:
    """The reference rewritten through `loaded`, made under a spinner when it is not up to date (the check is quick)."""
    line = st.empty()
    try:
        with st.spinner(f"Mapping the reference through {loaded.name} (done once, then reused)"):
            mapped = api.mapped_reference(reference, loaded.path, progress=lambda text: line.caption(text))
    except TtraceError as error:
        stop_with(str(error))
    line.empty()
    return mapped


def load_comparison(reference: Path, candidate: Path, partial_view: Callable[[api.StreamedRows], None] | None = None):
    """The comparison table from the api (cached on disk). The first computation of a large pair is a
    streamed job: with `partial_view`, the page draws the rows compared so far with it, refreshed every
    `POLL_S`, and the whole page once the table is complete; without, it shows the job's progress."""
    try:
        lookup = api.comparison_lookup(reference, candidate, SETTINGS)  # asked once; the calls below take the answer
        if lookup.table is not None:
            return lookup.table
        if not api.comparison_streams(reference, candidate):
            return _compare_in_page(reference, candidate, lookup)
        job = api.submit_comparison(reference, candidate, SETTINGS, lookup=lookup)
    except TtraceError as error:
        stop_with(str(error))
    _streamed_comparison(job, partial_view)
    st.stop()


def table_unless_streamed(reference: Path, candidate: Path):
    """The pair's comparison table (cached, or compared here when the pair is small); None when its first
    comparison would be a streamed job (a large pair), so a page showing many pairs never blocks on one:
    that pair's heatmap streams it. Raises TtraceError, for the page to show as that pair's one line."""
    lookup = api.comparison_lookup(reference, candidate, SETTINGS)
    if lookup.table is not None:
        return lookup.table
    if api.comparison_streams(reference, candidate):
        return None
    return _compare_in_page(reference, candidate, lookup)


def _compare_in_page(reference: Path, candidate: Path, lookup: api.CacheLookup):
    bar = st.empty()

    def progress(done: int, total: int) -> None:
        if done == 1 or done == total or done % 50 == 0:
            bar.progress(done / max(total, 1), text=f"comparing {done}/{total} tensors (done once, then cached)")

    result = api.comparison_table(reference, candidate, SETTINGS, progress=progress, lookup=lookup)
    bar.empty()
    return result


@st.fragment(run_every=POLL_S)
def _streamed_comparison(job: api.Job, partial_view: Callable[[api.StreamedRows], None] | None) -> None:
    known_key = f"_streamed:{job.directory}"
    rows = st.session_state[known_key] = api.streamed_rows(job, st.session_state.get(known_key))
    if rows.state == "complete":
        st.rerun()  # the whole page, now from the cached table
    if rows.state != "running":
        stop_with(f"the comparison stopped ({rows.state}): {rows.message}")
    total = rows.num_total or 0
    text = (f"comparing {rows.num_done}/{total} tensors in execution order (done once, then cached)" if total
            else "opening both runs")
    st.progress(rows.num_done / total if total else 0.0, text=text)
    if partial_view is not None and not rows.frame.empty:
        partial_view(rows)


def legend() -> None:
    """The words of the pages (ratio, mismatch, drift...) explained, folded away until asked for."""
    with st.expander("What ratio, mismatch and drift mean", icon=":material/help:"):
        st.markdown(cells.GLOSSARY)


def pair_caption(state: ViewState) -> None:
    through = f" through the map `{state.map}`" if state.map else ""
    st.caption(f"reference `{state.ref}`{through} · candidate `{state.cand}` · root `{dashboard_root()}`")


@st.cache_data(max_entries=8, show_spinner=False)
def _cells_of(keys: tuple[tuple[str, str, int], ...], rows_by: str, _frames: dict):
    return matrix.matrix_cells(_frames, rows_by)


def table_identity(result) -> tuple[str, int]:
    """A comparison table's name in Streamlit's caches: its file and the file's mtime (a recomputed table is new)."""
    return str(result.path), result.path.stat().st_mtime_ns if result.path.exists() else 0


def matrix_cells(results: dict, rows_by: str):
    """`matrix.matrix_cells` of the comparison tables `results` (layout -> ComparisonTable), cached by
    (layout, table path, mtime) and the rows choice: a rerun (a click, a narrowed selection) reuses it."""
    keys = tuple((layout, *table_identity(result)) for layout, result in results.items())
    return _cells_of(keys, rows_by, {layout: result.frame for layout, result in results.items()})
