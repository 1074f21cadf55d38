import pytest

from ttrace_dashboard.state import ALL_MICRO_BATCHES, ViewState, query_from_state, state_from_query, view_from_click

FULL = ViewState(ref="fp32/reference", cand="fp32/bug", map="maps/hf to mine.toml", cands=("fp32/bug", "fp32/tp2"),
                 tensor="forward/layers.0.attn/output.0", step=2, mb=3, rank=1, module="layers.0.attn", rows="layers")


def test_the_url_round_trips_every_field():
    assert state_from_query(query_from_state(FULL)) == FULL
    assert query_from_state(ViewState(ref="a")) == {"ref": "a"}
    assert query_from_state(FULL)["cands"] == "fp32/bug,fp32/tp2"
    assert query_from_state(FULL)["map"] == "maps/hf to mine.toml"  # a file under the root, or a shipped map's name


def test_a_link_with_a_map_keeps_it_through_the_url_and_a_page_switch():
    from urllib.parse import parse_qsl, urlencode

    shared = ViewState(ref="hf", cand="tp2", map="hf-llama--megatron-gpt")
    assert state_from_query(dict(parse_qsl(urlencode(query_from_state(shared))))) == shared
    # a heatmap click keeps the map: the tensor page compares through it as well
    clicked = view_from_click({"selection": {"points": [{"customdata": ["forward/l/output.0", 0, 0]}]}}, shared)
    assert clicked.map == "hf-llama--megatron-gpt"


@pytest.mark.parametrize("params, expected", [
    ({"step": "x", "mb": "-", "rank": ""}, ViewState()),
    ({"mb": "all"}, ViewState(mb=ALL_MICRO_BATCHES)),
    ({"mb": "-1", "step": "0"}, ViewState(mb=-1, step=0)),
    ({"ref": ["a", "b"]}, ViewState(ref="a")),
    ({"tensor": ""}, ViewState()),
    ({"rows": "pixels"}, ViewState()),
    ({"cands": "fp32/a, fp32/b,,fp32/a"}, ViewState(cands=("fp32/a", "fp32/b"))),
    ({"cands": " , "}, ViewState()),
    ({"map": ""}, ViewState()),
    ({"map": "maps/tiny.toml"}, ViewState(map="maps/tiny.toml")),
], ids=["malformed-numbers-dropped", "all-micro-batches", "gradient-micro-batch", "repeated-key", "empty", "unknown-rows",
        "candidates-comma-separated", "no-candidates",
    "empty-map", "map-file"])
def test_state_from_query(params, expected):
    assert state_from_query(params) == expected


@pytest.mark.parametrize("event, expected", [
    (None, None),
    ({"selection": {"points": []}}, None),
    ({"selection": {"points": [{"x": 1, "y": 2}]}}, None),
    ({"selection": {"points": [{"customdata": ["grad/l.w/grad", 0, -1]}]}},
     ViewState(ref="r", cand="c", tensor="grad/l.w/grad", step=0, mb=-1)),
    ({"selection": {"points": [{"customdata": ["forward/l/output.0", 1, 2]}, {"customdata": ["other", 0, 0]}]}},
     ViewState(ref="r", cand="c", tensor="forward/l/output.0", step=1, mb=2)),
], ids=["no-event", "nothing-selected", "point-without-customdata", "gradient-cell", "first-point-wins"])
def test_a_click_opens_the_tensor_of_its_cell(event, expected):
    state = ViewState(ref="r", cand="c", step=5, mb=ALL_MICRO_BATCHES, rank=3)
    assert view_from_click(event, state) == expected
