"""Every dashboard page through AppTest, driven by its query parameters as a shared link would be."""

import json
import os
import shutil
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from tests.support.tiny_mlp import recorded_pair as record_pair
from tests.synthetic_runs import write_pair, write_run
from ttrace_core.compare.tolerances import DTYPE_TOLERANCES
from ttrace_core.service.dashboard import ROOT_ENV
from ttrace_dashboard.figures import FIRST_DIVERGENCE_COLOUR
from tests.support.pages import MAIN, errors_of as _errors, open_page as _open, url_of as _url

PAIR = {"ref": "reference", "cand": "candidate"}
FIRST = "forward/layers.0.act/output.0"


@pytest.fixture
def root(tmp_path, monkeypatch):
    write_pair(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "manifest.json").write_text("{")
    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    return tmp_path


def _figures(app: AppTest) -> list[dict]:
    return [json.loads(chart.proto.spec) for chart in app.get("plotly_chart")]


def test_runs_page_picks_a_pair_shows_its_verdict_and_writes_it_into_the_url(root):
    app = _open("runs")
    assert not app.exception
    assert _url(app) == PAIR
    assert any("broken" in warning.value and "not a valid manifest" in warning.value for warning in app.warning)
    assert any(f"first divergence at `{FIRST}`" in error for error in _errors(app))
    assert [box.value for box in app.selectbox] == ["reference", "candidate", ""]  # the map: none, the same code
    heatmap, layouts = app.main.get("page_link")  # straight to the heatmap of this pair, and to every layout of its reference
    assert heatmap.proto.page == "heatmap" and heatmap.proto.query_string == "ref=reference&cand=candidate"
    assert layouts.proto.page == "matrix" and layouts.proto.query_string == "ref=reference"


def test_heatmap_draws_clickable_cells_and_marks_the_first_divergence(root):
    app = _open("heatmap", **PAIR)
    assert not app.exception
    heatmap = _figures(app)[0]
    traces = {trace.get("name"): trace for trace in heatmap["data"]}
    marked = traces["first divergence"]
    assert marked["customdata"] == [[FIRST, 0, 0]]  # a click on the outline opens the first divergence itself
    assert all(len(point) == 3 for trace in heatmap["data"] for point in trace["customdata"])
    assert {"NaN in the candidate", "missing in one run"} <= set(traces)
    assert _url(app) == {**PAIR, "step": "0", "mb": "all", "rows": "modules"}


def test_heatmap_rows_per_layer_from_the_url(root):
    app = _open("heatmap", **PAIR, rows="layers")
    assert not app.exception
    heatmap = _figures(app)[0]
    labels = [a["text"] for a in heatmap["layout"]["annotations"] if a.get("xanchor") == "right"]
    assert labels == ["layers.0", "layers.1"]
    assert heatmap["data"][-1]["name"] == "first divergence" and heatmap["data"][-1]["customdata"] == [[FIRST, 0, 0]]


def test_heatmap_micro_batch_choice_lands_in_the_url(root):
    app = _open("heatmap", **PAIR)
    next(box for box in app.selectbox if box.label == "Micro-batch").set_value(1).run()
    assert not app.exception
    assert _url(app)["mb"] == "1"


def test_the_keyboard_way_opens_the_tensor_page(root):
    app = _open("heatmap", **PAIR)
    next(box for box in app.selectbox if box.label.startswith("Go to a tensor")).set_value((FIRST, 0, 0)).run()
    assert not app.exception
    assert app.title[0].value == FIRST
    assert _url(app) == {**PAIR, "tensor": FIRST, "step": "0", "mb": "0"}


def test_tensor_page_shows_the_shard_map_and_the_rank_that_carries_the_error(root):
    app = _open("tensor", **PAIR, tensor=FIRST, step=0, mb=0, rank=1)
    assert not app.exception
    assert app.title[0].value == FIRST
    shard_table = app.dataframe[0].value
    assert list(shard_table["rank"]) == [0, 1] and shard_table["error"][0] == 0 and shard_table["error"][1] > 0.1
    assert [chart.key for chart in app.get("plotly_chart")] == ["shard_map", "ranks", "image", "histogram", "history"]
    worst = app.dataframe[1].value
    assert int(worst["index"][0].strip("()").split(",")[0]) >= 4 and abs(worst["abs_diff"][0] - 1.0) < 1e-6  # in rank 1's rows
    assert _url(app) == {**PAIR, "tensor": FIRST, "step": "0", "mb": "0", "rank": "1"}
    rel = DTYPE_TOLERANCES["float32"][0]  # judged by the float32 dtype tolerance, by the norm test alone
    assert f"smallest error this comparison catches on this tensor: {rel:.3g} (test: norm)" in [c.value for c in app.caption]


@pytest.mark.parametrize("page", ["heatmap", "tensor"])
def test_a_path_outside_the_root_is_refused_on_the_page(root, page):
    app = _open(page, ref="../../../../etc", cand="../../../../etc", tensor=FIRST, step=0, mb=0)
    assert not app.exception
    assert any("outside the dashboard root" in error for error in _errors(app))
    assert not app.get("plotly_chart")


def test_a_truncated_trace_is_one_line_and_the_other_runs_stay_usable(root):
    write_run(root / "truncated", role="candidate", world_size=2)
    step_file = root / "truncated" / "rank_00000.step_000000.h5"
    step_file.write_bytes(step_file.read_bytes()[:200])
    app = _open("heatmap", ref="reference", cand="truncated")
    assert not app.exception
    (error,) = _errors(app)
    assert "rank_00000.step_000000.h5: not a readable HDF5 file" in error and "\n" not in error
    assert not _open("heatmap", **PAIR).exception


def test_pages_without_a_pair_point_to_the_runs_page(root):
    app = _open("heatmap")
    assert not app.exception and "Pick a reference and a candidate" in app.info[0].value


def test_a_pair_whose_evidence_is_incomplete_is_not_shown_as_passing(tmp_path, monkeypatch):
    """Every row passes, but one TP rank never recorded a replicated output: the Runs page and the
    heatmap say FAILED (incomplete) and name the missing replica instead of "the candidate matches"."""
    import shutil

    import h5py

    samples = Path(MAIN).parents[1] / "sample_traces" / "fp32"
    shutil.copytree(samples / "reference", tmp_path / "reference")
    shutil.copytree(samples / "tp2_sp_clean", tmp_path / "candidate")
    from tests.faults.meta_rows import drop_tensor

    with h5py.File(tmp_path / "candidate" / "rank_00001.step_000000.h5", "r+") as handle:  # its values lost, its row kept
        drop_tensor(handle, "forward/mb_0000/decoder.layers.0.mlp#output.1", keep_row=True)
    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    for page in ("runs", "heatmap"):
        app = _open(page, **PAIR)
        assert not app.exception and not app.success, page
        (banner,) = [error for error in _errors(app) if error.startswith("FAILED (incomplete)")]
        assert "missing-replica: 1 of 2361 expected copies were not recorded" in banner, banner
        assert "Evidence: 787/787 tensors compared element-wise; 2360/2361 copies" in banner, banner


def test_a_pair_whose_reference_did_not_train_is_refused_on_the_page(tmp_path, monkeypatch):
    """Both runs zeroed their loss: every tensor agrees, yet the Runs page and the heatmap say FAILED (refused)."""
    record_pair(tmp_path, loss_factor=0.0)
    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    for page in ("runs", "heatmap"):
        app = _open(page, **PAIR)
        assert not app.exception and not app.success, page
        (banner,) = [error for error in _errors(app) if error.startswith("FAILED (refused)")]
        assert banner.startswith("FAILED (refused): the reference did not train: every one of its 4 parameter "
                                 "gradients is zero at step 0; check that the reference's loss reaches backward"), banner


def _traces(figure: dict) -> dict[str, dict]:
    return {trace.get("name"): trace for trace in figure["data"]}


def _with_second_layout(root: Path) -> Path:
    shutil.copytree(root / "candidate", root / "tp2b")  # the same layout twice: a second row with the same cells
    return root


def test_matrix_draws_every_layout_of_the_reference_and_writes_them_into_the_url(root):
    app = _open("matrix", ref="reference")
    assert not app.exception and not _errors(app)
    (matrix,) = _figures(app)
    traces = _traces(matrix)
    assert traces["rows"]["y"] == ["candidate"]  # copied later: the page lists the candidates the root has now
    _with_second_layout(root)
    app = _open("matrix")  # no URL at all: the reference of a candidate, and every layout of it
    assert not app.exception and not _errors(app)
    assert _url(app) == {"ref": "reference", "cands": "candidate,tp2b", "rows": "modules"}
    traces = _traces(_figures(app)[0])
    assert traces["rows"]["y"] == ["candidate", "tp2b"]
    assert traces["first divergence"]["customdata"] == [["candidate", "layers.0.act"], ["tp2b", "layers.0.act"]]
    assert _figures(app)[0]["layout"]["xaxis"]["ticktext"] == ["layers.0.lin", "layers.0.act", "layers.1.norm",
                                                                "layers.1.lin", "layers.1.out"]
    assert "2 of 2 compared layouts diverge" in app.caption[0].value


def test_matrix_candidates_and_layer_columns_from_the_url(root):
    _with_second_layout(root)
    app = _open("matrix", ref="reference", cands="tp2b,elsewhere", rows="layers")
    assert not app.exception and not _errors(app)
    assert [w.value for w in app.warning if "elsewhere" in w.value] == [
        "`elsewhere` is not a candidate of `reference` under the root: left out"]
    assert _url(app) == {"ref": "reference", "cands": "tp2b", "rows": "layers"}
    (matrix,) = _figures(app)
    assert _traces(matrix)["rows"]["y"] == ["tp2b"] and matrix["layout"]["xaxis"]["ticktext"] == ["layers.0", "layers.1"]
    # a layer's cell opens the module that holds its worst tensor
    assert _traces(matrix)["first divergence"]["customdata"] == [["tp2b", "layers.0.act"]]
    assert app.multiselect[0].value == ["tp2b"]


@pytest.mark.parametrize("ref, message", [
    ("../../../../etc", "outside the dashboard root"),
    ("candidate", "candidate: not a reference run under "),
    ("broken", "broken: "),
], ids=["outside-root", "a-candidate", "broken-run"])
def test_matrix_refuses_a_bad_reference_on_the_page(root, ref, message):
    app = _open("matrix", ref=ref)
    assert not app.exception
    (error,) = _errors(app)
    assert message in error and "\n" not in error
    assert not app.get("plotly_chart")
    if ref != "../../../../etc":  # a link naming a run that is no reference: the way back to Runs
        assert [link.proto.page for link in app.main.get("page_link")] == ["runs"]


def test_matrix_shows_a_large_pair_as_not_compared_yet_with_a_link_to_its_heatmap(root, monkeypatch):
    from ttrace_core import api

    _with_second_layout(root)
    monkeypatch.setattr(api, "comparison_streams", lambda reference, candidate: Path(candidate).name == "tp2b")
    app = _open("matrix", ref="reference")
    assert not app.exception and not _errors(app)
    (matrix,) = _figures(app)
    assert _traces(matrix)["rows"]["y"] == ["candidate", "tp2b"]
    assert _traces(matrix)["first divergence"]["customdata"] == [["candidate", "layers.0.act"]]
    assert [a["text"] for a in matrix["layout"]["annotations"] if a.get("y") == "tp2b"] == [
        "not compared yet: open its heatmap"]
    (link,) = app.main.get("page_link")
    assert link.proto.page == "heatmap" and link.proto.query_string == "ref=reference&cand=tp2b"
    assert "1 of 1 compared layouts diverge" in app.caption[0].value


@pytest.mark.parametrize("rows, framed, replay", [("modules", "layers.1.lin", "layers.1.lin"),
                                                  ("layers", "layers.1", "layers.1.lin")], ids=["modules", "layers"])
def test_heatmap_frames_the_module_of_the_url_and_opens_replay_on_it(root, rows, framed, replay):
    app = _open("heatmap", **PAIR, module="layers.1.lin", rows=rows)
    assert not app.exception
    heatmap = _figures(app)[0]
    bold = [a["text"] for a in heatmap["layout"]["annotations"] if a["text"].startswith("<b>")]
    assert bold == [f"<b>{framed}</b>"]
    assert next(box for box in app.selectbox if box.label.startswith("Replay a module")).value == replay
    assert _url(app) == {**PAIR, "module": "layers.1.lin", "step": "0", "mb": "all", "rows": rows}


def test_matrix_keeps_every_successive_choice_in_the_url(root):
    # A widget's default alone is reread only when its identity changes: the second change used to be lost.
    _with_second_layout(root)
    shutil.copytree(root / "candidate", root / "tp2c")
    app = _open("matrix", ref="reference")
    assert app.multiselect[0].value == ["candidate", "tp2b", "tp2c"]
    app.multiselect[0].unselect("tp2b").run()
    app.multiselect[0].unselect("candidate").run()
    next(box for box in app.selectbox if box.label == "Columns").set_value("layers").run()
    assert not app.exception and app.multiselect[0].value == ["tp2c"]
    assert _url(app) == {"ref": "reference", "cands": "tp2c", "rows": "layers"}
    assert _traces(_figures(app)[0])["rows"]["y"] == ["tp2c"]


def test_runs_page_keeps_every_successive_pick_in_the_url(root):
    # The same bug as the matrix's: a selectbox set by `index=` alone lost every second pick.
    _with_second_layout(root)
    shutil.copytree(root / "candidate", root / "tp2c")
    app = _open("runs")
    candidate = next(box for box in app.selectbox if box.label == "Candidate")
    candidate.set_value("tp2b").run()
    next(box for box in app.selectbox if box.label == "Candidate").set_value("tp2c").run()
    assert not app.exception and _url(app) == {"ref": "reference", "cand": "tp2c"}
    next(box for box in app.selectbox if box.label == "Candidate").set_value("candidate").run()
    assert _url(app) == {"ref": "reference", "cand": "candidate"}


def test_heatmap_keeps_every_successive_choice_in_the_url(root):
    app = _open("heatmap", **PAIR)
    for mb in ("0", "1", "all"):
        next(box for box in app.selectbox if box.label == "Micro-batch").set_value(mb if mb == "all" else int(mb)).run()
        assert not app.exception and _url(app)["mb"] == mb
    for rows in ("layers", "modules"):
        next(box for box in app.selectbox if box.label == "Rows").set_value(rows).run()
        assert _url(app)["rows"] == rows


def test_tensor_and_localize_pages_keep_every_successive_pick_in_the_url(root):
    app = _open("tensor", **PAIR, tensor=FIRST, step=0, mb=0)
    for mb in (1, 0, 1):
        next(box for box in app.selectbox if box.label == "Step / micro-batch").set_value((0, mb)).run()
        assert not app.exception and _url(app)["mb"] == str(mb)
    for rank in (1, 0, 1):
        next(box for box in app.selectbox if box.label == "Highlight rank").set_value(rank).run()
        assert _url(app)["rank"] == str(rank)
    app = _open("localize", **PAIR)
    for module in ("layers.0.act", "layers.1.norm", "layers.0.act"):
        next(box for box in app.selectbox if box.label == "Replay target").set_value(module).run()
        assert not app.exception and _url(app)["module"] == module


def _sidebar_links(app: AppTest) -> dict[str, str]:
    return {link.proto.page: link.proto.query_string for link in app.sidebar.get("page_link")}


def _copy_run(source: Path, target: Path, **manifest_fields) -> Path:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(".ttrace", ".localize"))
    manifest = json.loads((target / "manifest.json").read_text())
    (target / "manifest.json").write_text(json.dumps({**manifest, **manifest_fields}))
    return target


def test_every_sidebar_link_carries_the_pair_picked_on_runs(root):
    """Issue 41: Streamlit's own navigation links dropped the query, so Heatmap, Tensor and Localize said
    "Pick a reference and a candidate" right after a pair was picked."""
    _with_second_layout(root)
    app = _open("runs")
    pair = "ref=reference&cand=candidate"
    assert _sidebar_links(app) == {"runs": pair, "matrix": "ref=reference", "heatmap": pair, "tensor": pair,
                                   "localize": pair}
    next(box for box in app.selectbox if box.label == "Candidate").set_value("tp2b").run()
    assert _sidebar_links(app)["heatmap"] == "ref=reference&cand=tp2b" == _sidebar_links(app)["localize"]
    app = _open("tensor", **PAIR, tensor=FIRST, step=0, mb=0)
    assert _sidebar_links(app)["localize"] == pair  # the pair only: the target page opens on its own default view


def test_a_new_candidate_brings_the_reference_of_its_precision(root):
    _copy_run(root / "reference", root / "bf16-reference", precision="bf16")
    _copy_run(root / "candidate", root / "bf16-candidate", precision="bf16")
    app = _open("runs", **PAIR)
    next(box for box in app.selectbox if box.label == "Candidate").set_value("bf16-candidate").run()
    assert not app.exception and _url(app) == {"ref": "bf16-reference", "cand": "bf16-candidate"}
    # a reference of another precision, picked by hand: the page names the matching one and links to it
    app = _open("runs", ref="bf16-reference", cand="candidate")
    assert any("`reference` is the reference of the same model in fp32" in info.value for info in app.info)
    assert [link.proto.query_string for link in app.main.get("page_link")
            if link.proto.page == "runs"] == ["ref=reference&cand=candidate"]


@pytest.mark.parametrize("query, warning", [
    ({"ref": "candidate", "cand": "reference"}, "The link's ref= and cand= are swapped"),
    ({"ref": "candidate", "cand": "candidate"}, "The link compares `candidate` with itself, which always passes"),
    ({"ref": "nowhere", "cand": "candidate"}, "The link's ref=`nowhere` is not a usable run under the root"),
], ids=["swapped", "itself", "bogus-ref"])
def test_the_runs_page_says_why_it_does_not_show_the_links_pair(root, query, warning):
    app = _open("runs", **query)
    assert not app.exception
    assert [w.value for w in app.warning if w.value.startswith("The link")] == [
        next(w.value for w in app.warning if w.value.startswith(warning))]
    assert _url(app) == PAIR  # the pair it shows instead, in the URL


@pytest.mark.parametrize("query, message", [
    ({"ref": "candidate", "cand": "candidate"}, "is compared with itself, which always passes"),
    ({"ref": "candidate", "cand": "reference"}, "the runs are swapped"),
    ({"ref": "nowhere", "cand": "candidate"}, "The link's ref=`nowhere` is not a run under"),
], ids=["itself", "swapped", "bogus-ref"])
def test_a_link_that_cannot_be_shown_says_so_and_offers_the_way_back(root, query, message):
    for page in ("heatmap", "tensor", "localize"):
        app = _open(page, **query)
        assert not app.exception
        (error,) = _errors(app)
        assert message in error and "ttrace example" not in error, page
        assert [link.proto.page for link in app.main.get("page_link")] == ["runs"]


def test_a_passing_pair_points_to_no_outline(root):
    _copy_run(root / "reference", root / "same", role="candidate")
    captions = [c.value for c in _open("runs", ref="reference", cand="same").caption]
    assert not any("outlined in yellow" in c for c in captions) and any("no cell is outlined" in c for c in captions)
    assert any("outlined in yellow" in c.value for c in _open("runs", **PAIR).caption)


def test_the_runs_table_shows_whole_cells_and_flags_an_entrypoint_that_is_gone(root):
    from ttrace_dashboard.runs import recorded_by_text

    assert recorded_by_text("ttrace_examples.megatron_gpt.train:run") == "ttrace_examples.megatron_gpt.train:run"
    assert "not found in this installation" in recorded_by_text("ttrace_core.examples.megatron_gpt.train:run")
    command = "python -m ttrace_examples megatron-gpt --config '{\"tp\": 2}'"  # how runs are recorded today
    assert recorded_by_text(command) == command
    assert "not found in this installation" in recorded_by_text("python -m ttrace_core.examples megatron-gpt")
    assert recorded_by_text("torchrun --nproc-per-node 2 train.py") == "torchrun --nproc-per-node 2 train.py"
    app = _open("runs", **PAIR)
    assert not app.exception and app.table and not app.dataframe  # st.table wraps; st.dataframe cut the cells


def test_every_page_of_a_pair_explains_ratio_mismatch_and_drift(root):
    for page in ("runs", "heatmap", "tensor", "localize"):
        app = _open(page, **PAIR)
        assert not app.exception, page
        assert [e.label for e in app.expander if "ratio, mismatch and drift" in e.label], page


@pytest.mark.parametrize("page", ["heatmap", "runs"])
def test_one_page_load_asks_the_cache_once_on_a_miss_and_on_a_hit(root, monkeypatch, page):
    """"Is it cached?" is asked once per page load: each run is fingerprinted once and its manifest read once by
    the cache lookup (service/comparisons.lookup_table), whether the table is then computed or read."""
    from ttrace_core.service import comparisons

    compare_runs = comparisons.compare_runs
    fingerprinted, manifests_read = [], []

    def spy(calls: list, original):
        def counted(run_dir, *args, **kwargs):
            calls.append(Path(run_dir).name)
            return original(run_dir, *args, **kwargs)
        return counted

    monkeypatch.setattr(comparisons, "comparison_fingerprint", spy(fingerprinted, comparisons.comparison_fingerprint))
    monkeypatch.setattr(comparisons, "read_manifest", spy(manifests_read, comparisons.read_manifest))
    compared = []
    monkeypatch.setattr(comparisons, "compare_runs", lambda *args, **kwargs: compared.append(1) or compare_runs(*args, **kwargs))
    for cached in (False, True):
        fingerprinted.clear(), manifests_read.clear(), compared.clear()
        app = _open(page, **PAIR)
        assert not app.exception
        assert _figures(app) if page == "heatmap" else any(f"`{FIRST}`" in error for error in _errors(app))
        assert compared == ([] if cached else [1])  # a miss computes the table, the next load reads it
        assert sorted(fingerprinted) == ["candidate", "reference"], f"cached={cached}"
        assert sorted(manifests_read) == ["candidate", "reference"], f"cached={cached}"


def test_the_heatmap_builds_a_steps_view_once_per_table(root, monkeypatch):
    """A revisit of a complete table draws the heatmap built the first time (the page's cached `step_view`); a
    table computed again (a new file time) is drawn from scratch."""
    from ttrace_dashboard import cells

    built = []
    heatmap_cells = cells.heatmap_cells
    monkeypatch.setattr(cells, "heatmap_cells", lambda *args: built.append(1) or heatmap_cells(*args))
    first = _open("heatmap", **PAIR)
    again = _open("heatmap", **PAIR)
    assert not first.exception and not again.exception
    assert len(built) == 1
    assert _figures(again) == _figures(first)
    table = next((root / "candidate" / ".ttrace").rglob("*.parquet"))
    os.utime(table, ns=(table.stat().st_atime_ns, table.stat().st_mtime_ns + 10**9))
    assert not _open("heatmap", **PAIR).exception
    assert len(built) == 2


def test_the_timeline_is_drawn_when_opened(root):
    """The heatmap page draws the timeline only once its expander is open (each load of a large pair's page paid
    for a second chart nobody had asked for); open, it holds one point per module and kind of the step."""
    closed = _open("heatmap", **PAIR)
    assert not closed.exception
    assert len(_figures(closed)) == 1
    assert [e.label for e in closed.expander if e.label.startswith("Timeline")]
    app = AppTest.from_file(MAIN, default_timeout=60)
    app.switch_page("../pages/heatmap.py")
    for name, value in PAIR.items():
        app.query_params[name] = value
    app.session_state["heatmap_timeline"] = True
    app.run()
    assert not app.exception
    heatmap, timeline = _figures(app)
    assert FIRST in {point[0] for trace in timeline["data"] for point in trace.get("customdata", [])}
    lines = [shape for shape in timeline["layout"]["shapes"] if shape["type"] == "line"]
    assert any(line["line"]["color"] == FIRST_DIVERGENCE_COLOUR for line in lines)  # the first divergence marked
