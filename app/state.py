"""The view state of every page, and the URL that carries it: pure functions, no streamlit.

A view is (ref, cand, map, cands, tensor, step, mb, rank, module, rows); each is a query parameter of the same
name, so a copied URL opens the same view (`cands`, the layout matrix's candidates, is comma-separated).
`ref`, `cand` and `cands` are paths relative to the dashboard's root and are resolved only through
`ttrace_core.api.path_under_root`, which refuses anything outside it; so is `map` when it is not the name of
a shipped correspondence map (then it is a .toml file under the root).
A click on a heatmap cell is a plotly selection; `view_from_click` turns it into the tensor view's state.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from collections.abc import Mapping

ROW_CHOICES = ("modules", "layers")
MODULE_ROWS_BY_DEFAULT = 200
"""Past this many modules the heatmap opens with one row per layer (a 48-layer GPT has 774 modules)."""


def default_rows(num_modules: int) -> str:
    """The heatmap's rows when the link names none: "modules", or "layers" for a large model."""
    return "layers" if num_modules > MODULE_ROWS_BY_DEFAULT else "modules"

ALL_MICRO_BATCHES = "all"
"""`mb=all` on the heatmap: the worst over micro-batches."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ViewState:
    ref: str | None = None
    cand: str | None = None
    map: str | None = None
    """The correspondence map the reference is compared through (another implementation, docs/porting.md): a
    shipped map's name, or the path of a .toml map file relative to the root; None: the same code."""
    cands: tuple[str, ...] | None = None
    """The layout matrix's candidates (run paths), in the URL as "a,b"."""
    tensor: str | None = None
    """"phase/fqn/slot" (ttrace_core.compare.table.tensor_id)."""
    step: int | None = None
    mb: int | str | None = None
    """A global micro-batch id, -1 for gradients and parameters, or "all"."""
    rank: int | None = None
    module: str | None = None
    rows: str | None = None
    """Heatmap rows: "modules" or "layers" (every module of a layer in one row)."""


def _as_int(text: str | None) -> int | None:
    try:
        return None if text in (None, "") else int(text)
    except ValueError:
        return None


def candidates_from_text(text: str | None) -> tuple[str, ...] | None:
    """The `cands` parameter: comma-separated run paths, blanks and repeats dropped; None when empty."""
    names = [name.strip() for name in (text or "").split(",")]
    return tuple(dict.fromkeys(name for name in names if name)) or None


def state_from_query(params: Mapping[str, str | list[str]]) -> ViewState:
    """Read a page's state from its query parameters; malformed numbers are dropped, not raised."""
    def first(name: str) -> str | None:
        value = params.get(name)
        if isinstance(value, list):
            value = value[0] if value else None
        return value or None

    mb_text = first("mb")
    mb = ALL_MICRO_BATCHES if mb_text == ALL_MICRO_BATCHES else _as_int(mb_text)
    return ViewState(ref=first("ref"), cand=first("cand"), map=first("map"), cands=candidates_from_text(first("cands")),
                     tensor=first("tensor"), step=_as_int(first("step")), mb=mb, rank=_as_int(first("rank")),
                     module=first("module"),
                     rows=first("rows") if first("rows") in ROW_CHOICES else None)


def query_from_state(state: ViewState) -> dict[str, str]:
    """The query parameters of a state, without the unset ones."""
    def text(value) -> str:
        return ",".join(value) if isinstance(value, tuple) else str(value)

    return {f.name: text(getattr(state, f.name)) for f in fields(state) if getattr(state, f.name) is not None}


def view_from_click(selection: Mapping | None, state: ViewState) -> ViewState | None:
    """The tensor view a heatmap click opens, or None when the click selected nothing.

    `selection` is what `st.plotly_chart(on_select="rerun")` returns; every clickable marker
    carries customdata [tensor, step, micro_batch].
    """
    points = ((selection or {}).get("selection") or {}).get("points") or []
    for point in points:
        data = point.get("customdata")
        if data and len(data) >= 3 and data[0]:
            return replace(state, tensor=str(data[0]), step=int(data[1]), mb=int(data[2]), rank=None, rows=None)
    return None
