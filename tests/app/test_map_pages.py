"""The dashboard with another implementation as the reference: a correspondence map in the URL (`map=`), picked
on the Runs page, suggested there when the pair's recorded model facts fit a shipped map. A hand-written pair:
separate q/k/v in the reference against one fused qkv in the candidate (as tests/core/canonicalize/
test_mapped_run.py builds it), and a map file under the dashboard root."""

from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

from ttrace_core.format.schema import TensorKey
from ttrace_core.service.dashboard import ROOT_ENV

from tests.support.tiny_map import SIZES, TINY_MAP, interleaved, write_run
from tests.support.pages import open_page as _open, url_of as _url

MAP = TINY_MAP
PAIR = {"ref": "hf", "cand": "cand"}
SHIPPED = "hf-llama--megatron-gpt"


def _key(phase: str, fqn: str, slot: str) -> TensorKey:
    return TensorKey(step=0, micro_batch=-1 if phase == "param" else 0, phase=phase, fqn=fqn, slot=slot)


@pytest.fixture
def root(tmp_path, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(size, 5, generator=generator) for name, size in SIZES.items()}
    outputs = {name: torch.randn(2, 3, size, generator=generator) for name, size in SIZES.items()}
    reference = {**{_key("param", f"l.0.{n}.weight", "value.initial"): w for n, w in weights.items()},
                 **{_key("forward", f"l.0.{n}", "output.0"): o for n, o in outputs.items()},
                 _key("forward", "l.0.act", "output.0"): torch.randn(2, 3, 4, generator=generator)}
    write_run(tmp_path / "hf", reference,
              {"config": {"model_type": "tiny", "num_key_value_heads": 2, "num_hidden_layers": 1}})
    candidate = {_key("param", "layers.0.qkv.weight", "value.initial"): interleaved(list(weights.values()), 0),
                 _key("forward", "layers.0.rotary", "output.0"): torch.ones(3, 1, 2),
                 _key("forward", "layers.0.qkv", "output.0"):
                     interleaved([o.transpose(0, 1) for o in outputs.values()], -1)}
    write_run(tmp_path / "cand", candidate, {"num_layers": 1}, role="candidate")
    (tmp_path / "maps").mkdir()
    (tmp_path / "maps" / "tiny.toml").write_text(MAP)
    (tmp_path / "maps" / "broken.toml").write_text(MAP.replace('groups = "groups"', 'groups = "kv_groups"', 1))
    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    return tmp_path


def _picker(app: AppTest):
    return next(box for box in app.selectbox if box.label == "Correspondence map")


def test_the_runs_page_compares_through_a_map_file_and_says_so(root):
    app = _open("runs", **PAIR, map="maps/tiny.toml")
    assert not app.exception and not app.error
    assert _picker(app).value == "maps/tiny.toml"
    assert (root / "hf" / ".ttrace" / "mapped" / "tiny" / "manifest.json").is_file()
    words = " ".join(info.value for info in app.info)
    assert "correspondence map `tiny`" in words and "separate q, k, v" in words and "fused qkv" in words
    assert any(s.value.startswith("PASSED (equivalent)") for s in app.success)
    unmapped = " ".join(m.value for m in app.markdown)
    assert "2 tensors without counterpart through the map" in unmapped
    assert "angles against cosines" in unmapped and "a module on one side only" in unmapped
    assert _url(app) == {**PAIR, "map": "maps/tiny.toml"}  # the link reproduces the view
    heatmap = next(link for link in app.main.get("page_link") if link.proto.page == "heatmap")
    assert "map=maps%2Ftiny.toml" in heatmap.proto.query_string  # and every page's link keeps the map
    assert all(link.proto.page != "matrix" for link in app.main.get("page_link"))


def test_the_heatmap_compares_through_the_map_of_its_link(root):
    app = _open("heatmap", **PAIR, map="maps/tiny.toml")
    assert not app.exception and not app.error
    assert any("through the map `maps/tiny.toml`" in caption.value for caption in app.caption)
    assert _url(app)["map"] == "maps/tiny.toml"
    sidebar = {link.proto.page: link.proto.query_string for link in app.sidebar.get("page_link")}
    assert all(sidebar[name].endswith("&map=maps%2Ftiny.toml") for name in ("runs", "heatmap", "tensor", "localize"))
    assert sidebar["matrix"] == "ref=hf"  # the layout matrix compares layouts of one code: no map


def test_without_the_map_the_pair_is_not_compared_through_one(root):
    app = _open("runs", **PAIR)
    assert not app.exception
    assert _picker(app).value == "" and "map" not in _url(app)
    assert not (root / "hf" / ".ttrace" / "mapped").exists()
    assert [info for info in app.info if "correspondence map" in info.value] == []  # no shipped map fits tiny


@pytest.mark.parametrize("map_param, expected", [
    ("maps/broken.toml", "names fact 'kv_groups', which [facts] does not define"),
    ("../elsewhere.toml", "outside the dashboard root"),
    ("no-such-map", "neither a shipped map"),
], ids=["invalid-map-file", "outside-the-root", "unknown-name"])
def test_a_bad_map_is_one_error_line(root, map_param, expected):
    app = _open("runs", **PAIR, map=map_param)
    assert not app.exception
    assert len(app.error) == 1 and expected in app.error[0].value and "\n" not in app.error[0].value
    assert not app.success


HIDDEN, VOCAB, FFN = 8, 32, 16
HF_LLAMA = {  # a one-layer LlamaForCausalLM of 2 heads and 1 key/value group, as its manifest records it
    "config": {"model_type": "llama", "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 1},
    "parameters": {"model.embed_tokens.weight": [VOCAB, HIDDEN], "lm_head.weight": [VOCAB, HIDDEN],
                   "model.norm.weight": [HIDDEN], "model.layers.0.input_layernorm.weight": [HIDDEN],
                   "model.layers.0.post_attention_layernorm.weight": [HIDDEN],
                   **{f"model.layers.0.self_attn.{n}_proj.weight": [s, HIDDEN] for n, s in (("q", 8), ("k", 4), ("v", 4))},
                   "model.layers.0.self_attn.o_proj.weight": [HIDDEN, HIDDEN],
                   "model.layers.0.mlp.gate_proj.weight": [FFN, HIDDEN], "model.layers.0.mlp.up_proj.weight": [FFN, HIDDEN],
                   "model.layers.0.mlp.down_proj.weight": [HIDDEN, FFN]}}
MEGATRON_LLAMA = {  # the same model in megatron-core's names: fused qkv [q; k; v] and fc1 [gate; up]
    "num_layers": 1,
    "parameters": {"embedding.word_embeddings.weight": [VOCAB, HIDDEN], "output_layer.weight": [VOCAB, HIDDEN],
                   "decoder.final_layernorm.weight": [HIDDEN], "decoder.layers.0.input_layernorm.weight": [HIDDEN],
                   "decoder.layers.0.pre_mlp_layernorm.weight": [HIDDEN],
                   "decoder.layers.0.self_attention.linear_qkv.weight": [16, HIDDEN],
                   "decoder.layers.0.self_attention.linear_proj.weight": [HIDDEN, HIDDEN],
                   "decoder.layers.0.mlp.linear_fc1.weight": [2 * FFN, HIDDEN],
                   "decoder.layers.0.mlp.linear_fc2.weight": [HIDDEN, FFN]}}


def test_a_shipped_map_is_offered_and_suggested_when_the_pair_is_two_implementations(root):
    one = {_key("forward", "x", "output.0"): torch.ones(2)}
    write_run(root / "hf_llama", one, HF_LLAMA)
    write_run(root / "megatron", one, MEGATRON_LLAMA, role="candidate")
    app = _open("runs", ref="hf_llama", cand="megatron")
    assert not app.exception
    assert SHIPPED in _picker(app).options and _picker(app).value == ""
    suggestion = next(info.value for info in app.info if "correspondence map" in info.value)
    assert f"`{SHIPPED}` relates them" in suggestion and "transformers `llama` model" in suggestion
    link = next(link for link in app.main.get("page_link") if link.proto.page == "runs")
    assert f"map={SHIPPED}" in link.proto.query_string
    # picking it puts it into the URL: the link reproduces the view
    _picker(app).set_value(SHIPPED).run()
    assert _url(app)["map"] == SHIPPED


def test_the_localize_page_replays_against_the_mapped_reference(root, monkeypatch):
    from ttrace_core import api

    submitted = []

    def submit(reference, candidate, module=None, **kwargs):  # what `ttrace localize --map` hands the replay
        submitted.append((Path(reference), Path(candidate), module))
        raise api.TtraceError("recorded, not replayed")

    monkeypatch.setattr(api, "submit_replay", submit)
    app = _open("localize", **PAIR, map="maps/tiny.toml")
    assert not app.exception and not app.error
    next(button for button in app.button if button.label == "Replay with reference inputs").click().run()
    assert submitted == [(root / "hf" / ".ttrace" / "mapped" / "tiny", root / "cand", None)]
    assert [error.value for error in app.error] == ["recorded, not replayed"]
    assert _url(app)["map"] == "maps/tiny.toml"


def _without(parameters: dict, name: str) -> dict:
    return {n: shape for n, shape in parameters.items() if n != name}


@pytest.mark.parametrize("reference, candidate, fits", [
    (HF_LLAMA, MEGATRON_LLAMA, True),
    (HF_LLAMA, {"num_layers": 1}, True),  # no parameters recorded: the [candidate_model] fact that agrees
    (HF_LLAMA, {**MEGATRON_LLAMA, "num_layers": 2}, False),
    (HF_LLAMA, {**MEGATRON_LLAMA, "parameters": {**MEGATRON_LLAMA["parameters"],
                                                  "decoder.layers.0.mlp.linear_fc1.weight": [FFN, HIDDEN]}}, False),
    (HF_LLAMA, {**MEGATRON_LLAMA, "parameters": _without(MEGATRON_LLAMA["parameters"], "output_layer.weight")}, False),
    (HF_LLAMA, {}, False),  # nothing to check the candidate by
    (HF_LLAMA, HF_LLAMA, False),  # the same implementation
    ({**HF_LLAMA, "config": _without(HF_LLAMA["config"], "num_key_value_heads")}, MEGATRON_LLAMA, False),
    ({"parameters": HF_LLAMA["parameters"]}, MEGATRON_LLAMA, False),  # no transformers config: the same code's run
], ids=["port", "facts-only", "layers-differ", "shape-differs", "parameter-unmapped", "candidate-silent",
        "same-implementation", "fact-missing-in-config", "no-config"])
def test_a_map_is_suggested_by_the_recorded_model_facts(reference, candidate, fits):
    from ttrace_dashboard.runs import suggested_maps
    from ttrace_core.api import RunInfo

    found = suggested_maps(RunInfo(path="hf", role="reference", world_size=1, model=reference),
                           RunInfo(path="cand", role="candidate", world_size=2, model=candidate))
    assert (SHIPPED in found) == fits
    assert "hf-llama--torchtitan-llama3" not in found  # its rules give torchtitan's names, not megatron's
