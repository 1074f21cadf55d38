"""record/selection.py: which modules a Tracer traces, under which name, and why the others are left out.

Tables over a tiny transformer-shaped model (named_modules: "", "layers", "layers.N", "layers.N.attn",
"layers.N.mlp", "layers.N.mlp.0", "layers.N.mlp.1", "head"), its wrapped forms (activation checkpointing,
torch.compile, a wrapper told by its child's name), renames and model chunks; then the real Tracer on the
tiny MLP records exactly the modules `traced_modules` names and writes `untraced_modules` as blind spots."""

import pytest
import torch
from torch import nn

from ttrace_core.format.reader import RunReader
from ttrace_core.format.tracer_config import TracerConfig
from ttrace_core.record.selection import global_name, is_selected, name_in_chunk, traced_modules, untraced_modules

from tests.support.tiny_mlp import mlp, record_step


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = nn.Sequential(nn.Linear(4, 4), nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(x))


class Model(nn.Module):
    def __init__(self, num_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(num_layers)])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _block_names(prefix: str) -> list[str]:
    return [prefix, f"{prefix}.attn", f"{prefix}.mlp", f"{prefix}.mlp.0", f"{prefix}.mlp.1"]


ALL = ["", "layers", *_block_names("layers.0"), *_block_names("layers.1"), "head"]

EXCLUDE = "not traced (tracer configuration: exclude): its own inputs and outputs are not recorded"
NOT_INCLUDED = "not traced (tracer configuration: not in include): its own inputs and outputs are not recorded"
ACTIVATIONS = ("activations not traced (tracer configuration: exclude_activations): its parameters, gradients and "
               "updates are recorded, its inputs and outputs are not")
FORWARD_ONLY = ("backward not hooked (tracer configuration: forward_only): its grad_output is recorded through tensor "
                "hooks on its outputs, its grad_input is not")


def _traced(config: TracerConfig, model: nn.Module) -> dict[str, bool]:
    """Global fqn -> whether its backward is hooked, in named_modules order."""
    return {fqn: backward for fqn, _, backward in traced_modules(config, model)}


@pytest.mark.parametrize("config, traced, untraced", [
    (TracerConfig(), {name: True for name in ALL}, {}),
    (TracerConfig(include=("layers.*",)),
     {name: True for name in ALL if name.startswith("layers.")},
     {"": NOT_INCLUDED, "layers": NOT_INCLUDED, "head": NOT_INCLUDED}),
    # A glob selects names, not subtrees: excluding "layers" leaves its children traced; excluding the root
    # never stands for its subtree.
    (TracerConfig(exclude=("", "layers")),
     {name: True for name in ALL if name not in ("", "layers")},
     {"": EXCLUDE, "layers": EXCLUDE}),
    # "layers.0*" leaves out the subtree; the blind spots name only its outermost module.
    (TracerConfig(exclude=("layers.0*",)),
     {name: True for name in ALL if not name.startswith("layers.0")},
     {"layers.0": EXCLUDE}),
    (TracerConfig(exclude_activations=("layers.*.mlp*",)),
     {name: True for name in ALL if ".mlp" not in name},
     {"layers.0.mlp": ACTIVATIONS, "layers.1.mlp": ACTIVATIONS}),
    (TracerConfig(forward_only=("head", "layers.1.attn")),
     {name: name not in ("head", "layers.1.attn") for name in ALL},
     {"layers.1.attn": FORWARD_ONLY, "head": FORWARD_ONLY}),
    # exclude wins over exclude_activations, which wins over forward_only, module by module.
    (TracerConfig(exclude=("layers.1",), exclude_activations=("layers.1*",), forward_only=("layers.1.attn", "head")),
     {name: name != "head" for name in ALL if not name.startswith("layers.1")},
     {"layers.1": EXCLUDE, "layers.1.attn": ACTIVATIONS, "layers.1.mlp": ACTIVATIONS, "head": FORWARD_ONLY}),
    # A subtree left out for one reason inside a module left out for another is listed on its own.
    (TracerConfig(exclude_activations=("layers.0",), exclude=("layers.0.mlp*",)),
     {name: True for name in ALL if name != "layers.0" and not name.startswith("layers.0.mlp")},
     {"layers.0": ACTIVATIONS, "layers.0.mlp": EXCLUDE}),
    # Everything left out: the root stands for nothing, so its children are the outermost modules listed.
    (TracerConfig(include=("nothing",)), {}, {"": NOT_INCLUDED, "layers": NOT_INCLUDED, "head": NOT_INCLUDED}),
], ids=["everything", "include", "exclude names", "exclude a subtree", "exclude_activations", "forward_only",
        "precedence", "nested reasons", "nothing included"])
def test_which_modules_are_traced_and_why_the_others_are_not(config, traced, untraced):
    model = Model()
    assert _traced(config, model) == traced
    assert untraced_modules(config, model) == untraced


def test_a_module_inside_an_ancestor_left_out_alone_is_listed_itself():
    """The docstring: the outermost of a *subtree* left out for the same reason. "layers" is left out alone (its
    children are traced), so "layers.0", excluded by name, is no part of a subtree left out and is listed."""
    config = TracerConfig(exclude=("layers", "layers.0"))
    assert "layers.0.attn" in _traced(config, Model()) and "layers.0" not in _traced(config, Model())
    assert untraced_modules(config, Model()) == {"layers": EXCLUDE, "layers.0": EXCLUDE}


def test_traced_modules_are_the_models_own_objects():
    model = Model()
    found = {fqn: module for fqn, module, _ in traced_modules(TracerConfig(), model)}
    assert found["layers.1.mlp.0"] is model.layers[1].mlp[0] and found[""] is model


def test_a_checkpoint_wrapper_inside_the_model_is_skipped_and_what_it_wraps_traced_under_its_name():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = Model()
    inner = model.layers[0]
    model.layers[0] = checkpoint_wrapper(inner)
    found = {fqn: module for fqn, module, _ in traced_modules(TracerConfig(), model)}
    assert list(found) == ALL
    assert found["layers.0"] is inner and found["layers.0.attn"] is inner.attn
    assert untraced_modules(TracerConfig(exclude=("layers.0*",)), model) == {"layers.0": EXCLUDE}


def test_a_wrapper_is_told_by_its_childs_name_not_its_class():
    """fully_shard swaps a module's class; FSDP1 and activation checkpointing name the wrapped child."""
    model = Model()
    inner = model.head
    model.head = nn.Module()
    model.head.add_module("_fsdp_wrapped_module", inner)
    found = {fqn: module for fqn, module, _ in traced_modules(TracerConfig(), model)}
    assert list(found) == ALL and found["head"] is inner


def test_torch_compiles_wrapper_at_the_root_is_traced_itself_and_the_module_it_wraps_skipped():
    model = Model()
    compiled = torch.compile(model)  # nothing compiles until it is called
    found = {fqn: module for fqn, module, _ in traced_modules(TracerConfig(), compiled)}
    assert list(found) == ALL
    assert found[""] is compiled and found["layers.0.attn"] is model.layers[0].attn
    assert all(module is not model for module in found.values())
    assert untraced_modules(TracerConfig(exclude=("",)), compiled) == {"": EXCLUDE}


@pytest.mark.parametrize("rename, local, expected", [
    ((), "layers.1.attn", "layers.1.attn"),
    ((("layers.1", "layers.3"),), "layers.1", "layers.3"),
    ((("layers.1", "layers.3"),), "layers.1.attn", "layers.3.attn"),
    ((("layers.1", "layers.3"),), "layers.10.attn", "layers.10.attn"),
    ((("layers.1", "layers.3"),), "layers.1._checkpoint_wrapped_module.attn", "layers.3.attn"),
    ((("layers.1", "layers.3"),), "_orig_mod.layers.1.mlp.0", "layers.3.mlp.0"),
    ((("layers.0", "layers.2"), ("layers", "blocks")), "layers.0.attn", "layers.2.attn"),
    ((("layers.0", "layers.2"), ("layers", "blocks")), "layers.1.attn", "blocks.1.attn"),
    ((("1", ""),), "1.decoder.layers.0", "decoder.layers.0"),
    ((("1", ""),), "1", ""),
    ((("", "model"),), "", "model"),
    ((("", "model"),), "layers.0", "layers.0"),
], ids=["no rename", "the prefix itself", "under the prefix", "not a whole component", "checkpoint wrapper dropped",
        "compile wrapper dropped", "first pair wins", "second pair", "a chunk's prefix dropped", "a chunk's root",
        "the root renamed", "only the root"])
def test_global_name(rename, local, expected):
    assert global_name(TracerConfig(rename=rename), local) == expected


def test_globs_match_this_ranks_names_and_the_trace_uses_the_renamed_ones():
    config = TracerConfig(rename=(("layers.1", "layers.3"),), exclude=("layers.3*",), forward_only=("layers.1.attn",))
    traced = _traced(config, Model())
    assert "layers.3.attn" in traced and not traced["layers.3.attn"]  # forward_only matched the local name
    assert not any(name.startswith("layers.1") for name in traced)
    assert untraced_modules(config, Model()) == {"layers.3.attn": FORWARD_ONLY}


@pytest.mark.parametrize("model_chunks, local, expected", [
    (0, "1.decoder.layers.0", "1.decoder.layers.0"),
    (2, "1.decoder.layers.0", "decoder.layers.0"),
    (2, "1", ""),
    (2, "0.head", "head"),
    (2, "", ""),
    (2, "decoder", "decoder"),
], ids=["one model", "inside a chunk", "a chunk's root", "chunk 0", "the list itself", "no chunk index"])
def test_name_in_chunk(model_chunks, local, expected):
    assert name_in_chunk(TracerConfig(model_chunks=model_chunks), local) == expected


@pytest.mark.parametrize("config, selected", [
    (TracerConfig(model_chunks=2), ["", "0", "0.layers.0", "0.head", "1", "1.layers.0", "1.head"]),
    (TracerConfig(model_chunks=2, exclude=("",)), ["0.layers.0", "0.head", "1.layers.0", "1.head"]),
    (TracerConfig(model_chunks=2, include=("head",)), ["0.head", "1.head"]),
    (TracerConfig(include=("head",)), []),
    (TracerConfig(exclude=("",)), ["0", "0.layers.0", "0.head", "1", "1.layers.0", "1.head"]),
], ids=["chunks", "chunk roots excluded by the root's glob", "one glob, every chunk", "one model: the full name",
        "one model: only the root"])
def test_is_selected_matches_the_name_within_its_chunk(config, selected):
    names = ["", "0", "0.layers.0", "0.head", "1", "1.layers.0", "1.head"]
    assert [name for name in names if is_selected(config, name)] == selected


def test_chunks_are_traced_under_their_renamed_names():
    chunks = nn.ModuleList([Model(1), Model(1)])
    config = TracerConfig(model_chunks=2, exclude=("", "layers"), rename=(("0.layers.0", "layers.0"),
                                                                           ("1.layers.0", "layers.1"), ("0", ""), ("1", "")))
    traced = [fqn for fqn, _, _ in traced_modules(config, chunks)]
    assert traced == [*_block_names("layers.0"), "head", *_block_names("layers.1"), "head"]
    assert untraced_modules(config, chunks) == {"": EXCLUDE, "layers": EXCLUDE}


def test_the_tracer_records_the_traced_modules_and_writes_the_others_as_blind_spots(tmp_path):
    """The tiny MLP: "0" Linear, "1" GELU, "2" Linear."""
    config = TracerConfig(exclude=("",), exclude_activations=("1",), forward_only=("2",))
    assert _traced(config, mlp()) == {"0": True, "2": False}
    record_step(tmp_path, role="reference", config=config)
    with RunReader(tmp_path) as reader:
        slots = {(k.phase, k.fqn, k.slot) for k in reader.keys()
                 if k.phase in ("forward", "backward") and not k.slot.startswith("scalar.")}
        blind_spots = reader.manifest.blind_spots
    assert slots == {("forward", "0", "input.0"), ("forward", "0", "output.0"), ("backward", "0", "grad_output.0"),
                     ("forward", "2", "input.0"), ("forward", "2", "output.0"), ("backward", "2", "grad_output.0")}
    assert blind_spots == untraced_modules(config, mlp()) == {"": EXCLUDE, "1": ACTIVATIONS, "2": FORWARD_ONLY}

