"""Correspondence maps (canonicalize/correspondence.py): decoding with one clear line per bad map, the
unmapped globs, and the weight conversion derived from the same rules, round trip and exact layout, on the
shipped HF Llama <-> megatron-core map."""

from pathlib import Path

import pytest
import torch

from ttrace_core.canonicalize.correspondence import (
    candidate_shapes, candidate_state, declared_unmapped, facts_from_config, glob_regex, load_map, reference_state,
)
from ttrace_core.errors import MapError
from ttrace_core.integrations.shipped_maps import MAPS_DIR, find_map, shipped_map_names

LLAMA = "hf-llama--megatron-gpt"
VALID = '''
name = "tiny"
reference = "a"
candidate = "b"
[facts]
groups = "num_key_value_heads"
[[parameters]]
candidate = "layers.{layer}.qkv.weight"
reference = ["l.{layer}.q.weight", "l.{layer}.k.weight", "l.{layer}.v.weight"]
transform = [{op = "concat", dim = 0, groups = "groups"}]
[[tensors]]
candidate = "layers.{layer}.qkv"
slots = ["output.0"]
reference = ["l.{layer}.q", "l.{layer}.k", "l.{layer}.v"]
transform = [{op = "concat", dim = -1, groups = "groups"}]
[[unmapped]]
side = "candidate"
tensors = ["forward/layers.*.rotary/**"]
reason = "angles against cosines"
'''


def write_map(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(text)
    return path


def test_every_shipped_map_decodes():
    assert LLAMA in shipped_map_names()
    for name in shipped_map_names():
        loaded = find_map(name)
        assert loaded.name == name and loaded.path == (MAPS_DIR / f"{name}.toml").resolve()


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: t.replace('name = "tiny"', 'name = "tiny"\ncolour = "red"'), r"\$: Object contains unknown field `colour`"),
    (lambda t: t.replace('dim = 0, groups', 'dim = "zero", groups'), r"\$\.parameters\[0\]\.transform\[0\]\.dim: Expected `int`"),
    (lambda t: t.replace('op = "concat", dim = 0', 'op = "shuffle", dim = 0'), r"\$\.parameters\[0\]\.transform\[0\]"),
    (lambda t: t.replace('candidate = "layers.{layer}.qkv.weight"', 'candidate = "layers.{block}.qkv.weight"'),
     r"\$\.parameters\[0\]\.candidate: placeholder \{block\} does not appear"),
    (lambda t: t.replace('groups = "num_key_value_heads"', 'heads = "num_attention_heads"'),
     r"\$\.parameters\[0\]\.transform: names fact 'groups', which \[facts\] does not define"),
    (lambda t: t.replace('transform = [{op = "concat", dim = 0, groups = "groups"}]', 'transform = [{op = "sum"}]'),
     r"\$\.parameters\[0\]\.transform\[0\]: op 'sum' cannot be inverted"),
    (lambda t: t.replace('slots = ["output.0"]', 'slots = ["scalar.loss"]'), r"\$\.tensors\[0\]\.slots: slot 'scalar.loss' is a step scalar"),
    (lambda t: t.replace('slots = ["output.0"]', 'slots = ["result"]'), r"\$\.tensors\[0\]\.slots: slot 'result' is not a ttrace slot"),
    (lambda t: t.replace('transform = [{op = "concat", dim = -1, groups = "groups"}]', 'transform = []'),
     r"\$\.tensors\[0\]\.transform: 3 reference tensors need exactly one op that combines them"),
    (lambda t: t.replace('reason = "angles against cosines"', 'reason = " "'), r"\$\.unmapped\[0\]: give the tensors"),
    (lambda t: t + "\n[[parameters]\n", "not TOML"),
    (lambda t: t.replace('transform = [{op = "concat", dim = 0, groups = "groups"}]',
                         'transform = [{op = "concat", dim = 0, groups = "groups"}, {op = "select", dim = 0, index = 0, count = 2}]'),
     r"\$\.parameters\[0\]\.transform\[1\]: a select op comes first"),
    (lambda t: t.replace('transform = [{op = "concat", dim = 0, groups = "groups"}]',
                         'transform = [{op = "select", dim = 0, index = "expert", count = 2}, {op = "concat", dim = 0, groups = "groups"}]'),
     r"\$\.parameters\[0\]\.transform\[0\]: select's index 'expert' is no placeholder of the candidate name"),
], ids=["unknown-field", "wrong-type", "unknown-op", "free-placeholder", "undefined-fact", "sum-in-parameter",
        "scalar-without-phase", "bad-slot", "pieces-not-combined", "empty-reason", "not-toml", "select-not-first",
        "select-index-not-a-placeholder"])
def test_a_bad_map_is_one_line_naming_file_and_key(tmp_path, change, message):
    path = write_map(tmp_path, change(VALID))
    with pytest.raises(MapError, match=message) as caught:
        load_map(path)
    text = str(caught.value)
    assert text.startswith(str(path)) and "\n" not in text and "docs/porting.md" in text


def test_valid_map_decodes(tmp_path):
    loaded = load_map(write_map(tmp_path, VALID))
    assert loaded.name == "tiny" and len(loaded.spec.parameters) == 1 and len(loaded.digest) == 64


def test_unknown_map_names_the_shipped_ones(tmp_path):
    with pytest.raises(MapError, match=f"--map hf-lama: no shipped map of that name.*{LLAMA}"):
        find_map("hf-lama")
    with pytest.raises(MapError, match="cannot read the map"):
        find_map(tmp_path / "missing.toml")


@pytest.mark.parametrize(("glob", "tensor", "matches"), [
    ("backward/model.layers.*/grad_input.0", "backward/model.layers.3/grad_input.0", True),
    ("backward/model.layers.*/grad_input.0", "backward/model.layers.3.mlp/grad_input.0", False),
    ("forward//**", "forward//input.input_ids", True),
    ("forward/x/input.[01]", "forward/x/input.2", False),
    ("forward/x/input.[!01]", "forward/x/input.2", True),
], ids=["one-component", "star-stops-at-dots", "double-star-crosses", "class", "negated-class"])
def test_unmapped_globs_stay_within_a_name_component(glob, tensor, matches):
    assert bool(glob_regex(glob).match(tensor)) is matches


def test_declared_unmapped_gives_the_reason(tmp_path):
    spec = load_map(write_map(tmp_path, VALID)).spec
    assert declared_unmapped(spec, "candidate", "forward/layers.0.rotary/output.0").reason == "angles against cosines"
    assert declared_unmapped(spec, "reference", "forward/layers.0.rotary/output.0") is None


# ---- the weight conversion of the shipped Llama map ---------------------------------------------------

LLAMA_CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
HIDDEN, HEAD_DIM, FFN, VOCAB = 8, 2, 12, 10


def llama_shapes(tied: bool = False) -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    for layer in range(2):
        prefix = f"model.layers.{layer}"
        shapes |= {f"{prefix}.self_attn.q_proj.weight": (4 * HEAD_DIM, HIDDEN), f"{prefix}.self_attn.k_proj.weight": (2 * HEAD_DIM, HIDDEN),
                   f"{prefix}.self_attn.v_proj.weight": (2 * HEAD_DIM, HIDDEN), f"{prefix}.self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                   f"{prefix}.mlp.gate_proj.weight": (FFN, HIDDEN), f"{prefix}.mlp.up_proj.weight": (FFN, HIDDEN),
                   f"{prefix}.mlp.down_proj.weight": (HIDDEN, FFN), f"{prefix}.input_layernorm.weight": (HIDDEN,),
                   f"{prefix}.post_attention_layernorm.weight": (HIDDEN,)}
    return shapes


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_weight_conversion_round_trips(tied):
    loaded, shapes = find_map(LLAMA), llama_shapes(tied)
    facts = facts_from_config(loaded, LLAMA_CONFIG, "the test config")
    hf = {name: torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i, (name, shape) in enumerate(shapes.items())}
    megatron = candidate_state(loaded, hf, facts)
    assert {name: tuple(v.shape) for name, v in megatron.items()} == candidate_shapes(loaded, shapes, facts)
    assert ("output_layer.weight" in megatron) is not tied
    assert megatron["decoder.layers.1.self_attention.linear_qkv.weight"].shape == (8 * HEAD_DIM, HIDDEN)
    assert megatron["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * FFN, HIDDEN)
    back = reference_state(loaded, megatron, shapes, facts)
    assert set(back) == set(hf) and all(torch.equal(back[name], hf[name]) for name in hf)


def test_fused_qkv_rows_follow_megatrons_query_groups():
    """Rows of head h of q_proj, of group g of k_proj / v_proj, land where megatron's linear_qkv keeps them:
    group g's [q heads 2g, 2g+1; k_g; v_g], head_dim rows each."""
    loaded, shapes = find_map(LLAMA), llama_shapes()
    facts = facts_from_config(loaded, LLAMA_CONFIG, "the test config")
    hf = {name: torch.zeros(shape) for name, shape in shapes.items()}
    for name, base in (("q_proj", 0), ("k_proj", 100), ("v_proj", 200)):
        weight = hf[f"model.layers.0.self_attn.{name}.weight"]
        weight[:] = (base + torch.arange(weight.shape[0] // HEAD_DIM).repeat_interleave(HEAD_DIM))[:, None]
    fused = candidate_state(loaded, hf, facts)["decoder.layers.0.self_attention.linear_qkv.weight"][::HEAD_DIM, 0]
    assert fused.tolist() == [0, 1, 100, 200, 2, 3, 101, 201]


def test_conversion_refuses_what_it_cannot_give():
    loaded, shapes = find_map(LLAMA), llama_shapes()
    facts = facts_from_config(loaded, LLAMA_CONFIG, "the test config")
    megatron = candidate_state(loaded, {name: torch.zeros(s) for name, s in shapes.items()}, facts)
    with pytest.raises(MapError, match="no \\[\\[parameters\\]\\] rule gives reference parameter model.extra.weight"):
        reference_state(loaded, megatron, {**shapes, "model.extra.weight": (3,)}, facts)
    del megatron["decoder.final_layernorm.weight"]
    with pytest.raises(MapError, match="gives candidate parameter decoder.final_layernorm.weight, which the candidate's"):
        reference_state(loaded, megatron, shapes, facts)
    with pytest.raises(MapError, match=r"\$\.facts\.groups reads 'num_key_value_heads'.*the test config has no"):
        facts_from_config(loaded, {"num_attention_heads": 4}, "the test config")


def test_rotary_on_chosen_pieces_rotates_q_and_k_not_v_and_inverts():
    """torchtitan's wqkv: q and k rows move to interleaved pairs, v rows stay; the inverse gives HF's back."""
    from ttrace_core.canonicalize import map_transforms as mt

    q, k, v = (torch.arange(4.0).reshape(4, 1) + offset for offset in (0, 10, 20))
    ops = [mt.Rotary(dim=0, head_dim=4, source="half-split", target="interleaved", pieces=[0, 1]),
           mt.Concat(dim=0, groups=1)]
    fused = mt.candidate_tensor(ops, [q, k, v], {}, "test")
    assert fused.flatten().tolist() == [0, 2, 1, 3, 10, 12, 11, 13, 20, 21, 22, 23]
    back = mt.reference_pieces(ops, fused, [(4, 1)] * 3, {}, "test")
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


# ---- the weight conversion of the shipped Mixtral map: experts selected from HF's fused parameters -----

MIXTRAL = "hf-mixtral--megatron-gpt-moe"
MIXTRAL_CONFIG = {**LLAMA_CONFIG, "num_local_experts": 3, "max_position_embeddings": 4}


def mixtral_shapes() -> dict[str, tuple[int, ...]]:
    shapes = {name: shape for name, shape in llama_shapes().items() if ".mlp." not in name}
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp"
        shapes |= {f"{prefix}.gate.weight": (3, HIDDEN), f"{prefix}.experts.gate_up_proj": (3, 2 * FFN, HIDDEN),
                   f"{prefix}.experts.down_proj": (3, HIDDEN, FFN)}
    return shapes


def test_experts_are_slices_of_hfs_fused_parameters_and_round_trip():
    loaded, shapes = find_map(MIXTRAL), mixtral_shapes()
    facts = facts_from_config(loaded, MIXTRAL_CONFIG, "the test config")
    hf = {name: torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i, (name, shape) in enumerate(shapes.items())}
    megatron = candidate_state(loaded, hf, facts)
    assert {name: tuple(v.shape) for name, v in megatron.items()} == candidate_shapes(loaded, shapes, facts)
    experts = sorted(name for name in megatron if ".local_experts." in name)
    assert len(experts) == 2 * 3 * 2  # layers x experts x (fc1, fc2)
    for expert in range(3):
        fc1 = megatron[f"decoder.layers.1.mlp.experts.local_experts.{expert}.linear_fc1.weight"]
        assert torch.equal(fc1, hf["model.layers.1.mlp.experts.gate_up_proj"][expert])  # [gate; up] on both sides
        fc2 = megatron[f"decoder.layers.1.mlp.experts.local_experts.{expert}.linear_fc2.weight"]
        assert torch.equal(fc2, hf["model.layers.1.mlp.experts.down_proj"][expert])
    assert torch.equal(megatron["decoder.layers.0.mlp.router.weight"], hf["model.layers.0.mlp.gate.weight"])
    back = reference_state(loaded, megatron, shapes, facts)
    assert set(back) == set(hf) and all(torch.equal(back[name], hf[name]) for name in hf)


def test_an_expert_the_candidate_lacks_is_refused():
    loaded, shapes = find_map(MIXTRAL), mixtral_shapes()
    facts = facts_from_config(loaded, MIXTRAL_CONFIG, "the test config")
    megatron = candidate_state(loaded, {name: torch.zeros(s) for name, s in shapes.items()}, facts)
    with pytest.raises(MapError, match=r"\$\.parameters\[6\]: decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight: "
                                       r"select index 0 of 2 along dim 0, but a piece of shape \(3, 24, 8\) has 3 there"):
        reference_state(loaded, megatron, shapes, {**facts, "experts": 2})  # a count that does not cover the experts
    del megatron["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"]
    with pytest.raises(MapError, match="gives candidate parameter decoder.layers.0.mlp.experts.local_experts.1.linear_fc2"):
        reference_state(loaded, megatron, shapes, facts)


def test_a_fused_parameter_whose_indices_no_rule_covers_is_refused(tmp_path):
    """A rule that selects one fixed index gives only that slice: the conversion names the index left over."""
    loaded = load_map(write_map(tmp_path, '''
name = "tiny"
reference = "a"
candidate = "b"
[[parameters]]
candidate = "first_expert.weight"
reference = ["experts.weight"]
transform = [{op = "select", dim = 0, index = 0, count = 2}]
'''))
    assert candidate_state(loaded, {"experts.weight": torch.arange(4.0).reshape(2, 2)}, {})["first_expert.weight"].tolist() == [0, 1]
    with pytest.raises(MapError, match=r"no \[\[parameters\]\] rule gives index 1 along dim 0 of reference parameter "
                                       r"experts.weight \(1 of 2 given\)"):
        reference_state(loaded, {"first_expert.weight": torch.zeros(2)}, {"experts.weight": (2, 2)}, {})
