"""megatron_cpu lets megatron-core's local path run on CPU/gloo and match a single-process reference.

The in-process tests check the patching itself (and restore everything); the distributed ones
spawn 2 gloo ranks each and compare TP/SP/PP/DDP/optimizer runs with a TP1 reference built in
the same ranks (see megatron_workers.py).
"""

from __future__ import annotations

import logging
import warnings
from types import SimpleNamespace

import pytest
import torch

from ttrace_core.integrations import megatron_cpu
from ttrace_core.record.launch import run_ranks

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed": expected on CPU
    pytest.importorskip("megatron.core")

WORKERS = "tests.integrations.megatron_workers"


@pytest.fixture
def megatron():
    """megatron.core modules the patches touch; disables megatron_cpu and restores the RNG afterwards."""
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.tensor_parallel.random as random
    import megatron.core.transformer.torch_norm as torch_norm

    rng_state = torch.get_rng_state()
    yield SimpleNamespace(clip_grads=clip_grads, distrib_optimizer=distrib_optimizer, optimizer=optimizer,
                          schedules=schedules, random=random, torch_norm=torch_norm)
    megatron_cpu.disable()
    torch.set_rng_state(rng_state)


def _patched_attributes(m: SimpleNamespace) -> dict[str, object]:
    """Every attribute enable() replaces, read the way megatron reads it."""
    cuda = {name: getattr(torch.cuda, name) for name in (
        "current_device", "synchronize", "Stream", "Event", "stream", "current_stream", "default_stream",
        "manual_seed", "get_rng_state", "set_rng_state", "default_generators")}
    return {
        **{f"torch.cuda.{name}": value for name, value in cuda.items()},
        "Tensor.cuda": torch.Tensor.cuda,
        "Tensor.type": torch.Tensor.type,
        "random._get_cuda_rng_state": m.random._get_cuda_rng_state,
        "random._set_cuda_rng_state": m.random._set_cuda_rng_state,
        "WrappedTorchNorm.__new__": vars(m.torch_norm.WrappedTorchNorm)["__new__"],
        "schedules.torch": m.schedules.torch,
        "optimizer.torch": m.optimizer.torch,
        "clip_grads.torch": m.clip_grads.torch,
        "clip_grads.clip_grad_by_total_norm_fp32": m.clip_grads.clip_grad_by_total_norm_fp32,
        "optimizer.clip_grad_by_total_norm_fp32": m.optimizer.clip_grad_by_total_norm_fp32,
        "Float16OptimizerWithFloat16Params.__init__": m.optimizer.Float16OptimizerWithFloat16Params.__init__,
        "DistributedOptimizer.__init__": m.distrib_optimizer.DistributedOptimizer.__init__,
        "random logger filters": tuple(logging.getLogger(m.random.__name__).filters),
    }


def _changed(before: dict, after: dict) -> set[str]:
    return {name for name in before if after[name] is not before[name] and after[name] != before[name]}


def test_enable_patches_is_idempotent_and_disable_restores(megatron):
    original = _patched_attributes(megatron)
    assert megatron_cpu.enable() is True
    patched = _patched_attributes(megatron)
    # Tensor.type is swapped only inside the optimizer constructors and the grad clip.
    assert _changed(original, patched) == set(original) - {"Tensor.type"}
    assert megatron_cpu.enable() is True and _patched_attributes(megatron) == patched
    tensor = torch.ones(2)
    assert torch.cuda.current_device() == torch.device("cpu")
    assert tensor.cuda() is tensor and tensor.type() == "torch.FloatTensor"
    assert megatron.schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert megatron_cpu.disable() is True and not megatron_cpu.is_enabled()
    assert _changed(original, _patched_attributes(megatron)) == set()
    assert "cuda" not in vars(torch.Tensor) and "type" not in vars(torch.Tensor)
    assert megatron_cpu.disable() is False


def test_enable_is_a_no_op_when_cuda_is_available(megatron, monkeypatch):
    original = _patched_attributes(megatron)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert megatron_cpu.enable() is False and not megatron_cpu.is_enabled()
    monkeypatch.undo()
    assert _changed(original, _patched_attributes(megatron)) == set()


def test_enable_on_an_unexpected_megatron_raises_and_rolls_back(megatron, monkeypatch):
    original = _patched_attributes(megatron)
    monkeypatch.delattr(megatron.optimizer, "Float16OptimizerWithFloat16Params")
    with pytest.raises(ValueError, match="written for megatron-core 0.16.1"):
        megatron_cpu.enable()
    monkeypatch.undo()
    assert not megatron_cpu.is_enabled() and _changed(original, _patched_attributes(megatron)) == set()


def test_rng_tracker_forks_the_cpu_generator(megatron, caplog):
    megatron_cpu.enable()
    seed = 42
    megatron.random.model_parallel_cuda_manual_seed(seed, tp_rank=1, ep_rank=0, etp_rank=0, force_reset_rng=True)
    tracker = megatron.random.get_cuda_rng_tracker()
    with caplog.at_level(logging.WARNING), tracker.fork():
        inside = torch.rand(4)
    outside = torch.rand(4)
    with tracker.fork():
        inside_again = torch.rand(4)
    # Megatron's seeds: data-parallel = seed (the default state), tensor-parallel = seed + 2718 + tp_rank.
    tp_stream = torch.rand(8, generator=torch.Generator().manual_seed(seed + 2718 + 1))
    assert torch.equal(torch.cat([inside, inside_again]), tp_stream)
    assert torch.equal(outside, torch.rand(4, generator=torch.Generator().manual_seed(seed)))
    assert "CPU RNG state changed" not in caplog.text
    with pytest.raises(ValueError, match="use_cudagraphable_rng=False"):
        megatron.random._get_cuda_rng_state(graph_safe=True)


def _norm_config(**overrides) -> SimpleNamespace:
    fields = dict(normalization="LayerNorm", sequence_parallel=True, layernorm_zero_centered_gamma=False,
                  persist_layer_norm=False, memory_efficient_layer_norm=False)
    return SimpleNamespace(**{**fields, **overrides})


def test_torch_norm_allows_sequence_parallel_and_tags_params(megatron):
    wrapped_norm = megatron.torch_norm.WrappedTorchNorm
    with pytest.raises(AssertionError, match="sequence parallel"):
        wrapped_norm(_norm_config(), 8)
    megatron_cpu.enable()
    layer_norm, rms_norm = wrapped_norm(_norm_config(), 8, eps=1e-6), wrapped_norm(_norm_config(normalization="RMSNorm"), 8)
    assert type(layer_norm) is torch.nn.LayerNorm and layer_norm.eps == 1e-6 and type(rms_norm) is torch.nn.RMSNorm
    assert all(p.sequence_parallel for p in [*layer_norm.parameters(), *rms_norm.parameters()])
    assert not any(p.sequence_parallel for p in wrapped_norm(_norm_config(sequence_parallel=False), 8).parameters())
    with pytest.raises(ValueError, match="layernorm_zero_centered_gamma=False"):
        wrapped_norm(_norm_config(layernorm_zero_centered_gamma=True), 8)


@pytest.mark.distributed
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_matches_tp1(sequence_parallel):
    run_ranks(f"{WORKERS}:tp_matches_tp1", {"sequence_parallel": sequence_parallel}, 2, timeout_s=300)


@pytest.mark.distributed
@pytest.mark.parametrize("config", [
    {"tp": 2, "distributed_optimizer": False, "bf16": False},
    {"tp": 1, "distributed_optimizer": True, "bf16": False},
    {"tp": 2, "distributed_optimizer": False, "bf16": True},
], ids=["tp2-ddp-adam", "dp2-distributed-optimizer", "tp2-bf16-float16module"])
def test_ddp_optimizer_step_matches_torch_adamw(config):
    run_ranks(f"{WORKERS}:ddp_optimizer_step", config, 2, timeout_s=300)


@pytest.mark.distributed
def test_pipeline_parallel_matches_single_stage():
    run_ranks(f"{WORKERS}:pipeline_matches_single_stage", {"microbatches": 3}, 2, timeout_s=300)
