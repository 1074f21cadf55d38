"""The bug zoo (ttrace_examples/megatron_gpt/bugs.py): its registry, and what each patch changes.

In-process tests check the metadata and that apply()/undo() swap exactly the documented megatron
attribute and put the original object back. The distributed ones spawn 2 gloo ranks per group of
bugs and check, from identical weights, that each bug moves the quantity it targets while the clean
run matches a single-rank computation (see megatron_bug_workers.py).
"""

from __future__ import annotations

import importlib
import warnings

import pytest

from ttrace_examples.megatron_gpt.bugs import BUG_CLASSES, ZOO, ZooBug, apply_bug
from ttrace_core.integrations import megatron_cpu
from ttrace_core.record.launch import run_ranks

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed": expected on CPU
    pytest.importorskip("megatron.core")

WORKERS = "tests.examples.megatron_bug_workers"
NAMES = ("sp-final-norm-grad", "sp-router-replica", "attn-dq-wrong", "cp-attn-backward", "pp-tied-embedding-grad",
         "distopt-stale-params", "vocab-embedding-mask", "row-parallel-bias-per-rank", "sp-gather-wrong-dim",
         "swiglu-tp-shard", "fp8-amax-wrong-group", "expert-grad-scale", "expert-probs-twice", "loss-scale-dp-cp",
         "dp-grad-avg-twice")
LAYOUT_FLAGS = ("--tp", "--sp", "--pp", "--dp", "--dist-opt", "--precision", "--moe", "--ep", "--swiglu",
                "--tie-embeddings", "--cp")

# The attribute each bug replaces: (module, class or None, attribute).
FINALIZE = "megatron.core.distributed.finalize_model_grads"
BUFFER = "megatron.core.distributed.param_and_grad_buffer"
LAYERS = "megatron.core.tensor_parallel.layers"
PATCHED = {
    "sp-final-norm-grad": (FINALIZE, None, "_allreduce_non_tensor_model_parallel_grads"),
    "sp-router-replica": (FINALIZE, None, "_allreduce_non_tensor_model_parallel_grads"),
    "attn-dq-wrong": ("megatron.core.transformer.dot_product_attention", "DotProductAttention", "forward"),
    "pp-tied-embedding-grad": (FINALIZE, None, "_allreduce_word_embedding_grads"),
    "distopt-stale-params": (BUFFER, "_ParamAndGradBucketGroup", "start_param_sync"),
    "vocab-embedding-mask": (LAYERS, "VocabParallelEmbedding", "forward"),
    "row-parallel-bias-per-rank": (LAYERS, "RowParallelLinear", "forward"),
    "sp-gather-wrong-dim": (LAYERS, None, "dist_all_gather_func"),
    "swiglu-tp-shard": ("megatron.core.transformer.mlp", "MLP", "forward"),
    "fp8-amax-wrong-group": ("ttrace_core.integrations.fp8", None, "reduced_amaxes"),
    "expert-grad-scale": ("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel", "__init__"),
    "expert-probs-twice": ("megatron.core.transformer.mlp", "MLP", "forward"),
    "loss-scale-dp-cp": ("megatron.core.pipeline_parallel.schedules", None, "forward_step_calc_loss"),
    "dp-grad-avg-twice": (BUFFER, "_ParamAndGradBucketGroup", "start_grad_sync"),
}
NOT_RUNNABLE = {"cp-attn-backward": "context parallel"}


@pytest.fixture
def cpu_megatron():
    """megatron_cpu enabled in this process for the test; disabled again unless it was on before."""
    was_enabled = megatron_cpu.is_enabled()
    megatron_cpu.enable()
    yield
    if not was_enabled:
        megatron_cpu.disable()


def _owner(module: str, cls: str | None) -> object:
    owner = importlib.import_module(module)
    return getattr(owner, cls) if cls else owner


def test_registry_has_exactly_the_fourteen_names_with_complete_metadata():
    assert tuple(ZOO) == NAMES
    for name, bug in ZOO.items():
        assert isinstance(bug, ZooBug) and bug.name == name
        for field in ("upstream", "description", "culprit", "first_divergence"):
            assert getattr(bug, field).strip(), f"{name}: empty {field}"
        assert bug.bug_class in BUG_CLASSES, f"{name}: bug_class {bug.bug_class!r}"
        assert bug.runs_on in ("megatron-core", "torch-gpt"), f"{name}: runs_on {bug.runs_on!r}"
        phase, fqn, slot = bug.first_divergence.split(" / ")
        assert phase in ("forward", "backward", "grad", "param") and fqn and slot, bug.first_divergence
        assert bug.triggers and all(t.split()[0] in LAYOUT_FLAGS for t in bug.triggers), f"{name}: {bug.triggers}"
    assert {name for name, bug in ZOO.items() if bug.runs_on == "torch-gpt"} == set(NOT_RUNNABLE)


def test_zoo_bug_rejects_an_unknown_class():
    bug = ZOO["dp-grad-avg-twice"]
    with pytest.raises(ValueError, match="bug_class"):
        ZooBug(**{**vars(bug), "bug_class": "typo"})


def test_apply_bug_names_the_valid_bugs_when_unknown():
    with pytest.raises(ValueError, match="sp-final-norm-grad.*dp-grad-avg-twice"):
        apply_bug("no-such-bug")


@pytest.mark.parametrize("name", sorted(PATCHED))
def test_apply_swaps_one_attribute_and_undo_restores_it(cpu_megatron, name):
    module, cls, attribute = PATCHED[name]
    if name == "fp8-amax-wrong-group":
        fp8 = pytest.importorskip(module)
        if not hasattr(fp8, attribute):
            with pytest.raises(NotImplementedError, match="fp8"):
                apply_bug(name)
            return
    owner = _owner(module, cls)
    original, before = getattr(owner, attribute), dict(vars(owner))
    undo = apply_bug(name)
    try:
        assert getattr(owner, attribute) is not original, f"{name} did not patch {attribute}"
        assert {k for k in vars(owner) if vars(owner)[k] is not before.get(k)} == {attribute}
    finally:
        undo()
    assert getattr(owner, attribute) is original
    assert all(vars(owner).get(k) is value for k, value in before.items()) and set(vars(owner)) == set(before)


@pytest.mark.parametrize("name", sorted(NOT_RUNNABLE))
def test_bugs_megatron_cannot_run_on_cpu_say_so(name):
    with pytest.raises(NotImplementedError, match=NOT_RUNNABLE[name]):
        apply_bug(name)


def _fp8_emulation_available() -> bool:
    """fp8-amax-wrong-group needs the FP8 emulation layers (ttrace_core/integrations/fp8.py)."""
    try:
        fp8 = importlib.import_module("ttrace_core.integrations.fp8")
    except ImportError:
        return False
    return all(hasattr(fp8, name) for name in ("reduced_amaxes", "Fp8Recipe", "fp8_gpt_layer_local_spec"))


@pytest.mark.slow
@pytest.mark.parametrize("worker", ["tensor_parallel_bugs", "data_parallel_bugs", "pipeline_bugs"])
def test_each_bug_moves_what_it_targets_and_only_under_the_patch(worker):
    # tensor_parallel_bugs: sp-final-norm-grad, vocab-embedding-mask, row-parallel-bias-per-rank,
    #   sp-gather-wrong-dim, attn-dq-wrong (TP2+SP), swiglu-tp-shard (TP2), sp-router-replica (TP2+SP MoE),
    #   fp8-amax-wrong-group (TP2 fp8, when the emulation exists)
    # data_parallel_bugs: dp-grad-avg-twice, loss-scale-dp-cp, distopt-stale-params (DP2),
    #   expert-grad-scale (DP2 EP2 MoE)
    # pipeline_bugs: pp-tied-embedding-grad (PP2, tied embeddings)
    run_ranks(f"{WORKERS}:{worker}", {"fp8": _fp8_emulation_available()}, world_size=2, timeout_s=300)


def test_every_zoo_bug_has_a_matchable_culprit():
    from ttrace_examples.megatron_gpt.bugs import CULPRITS

    assert set(CULPRITS) == set(ZOO)
    for name, truth in CULPRITS.items():
        assert bool(truth.modules) != bool(truth.params), f"{name}: name modules or params + reduction, not both"
        assert not truth.params or truth.reduction, name
