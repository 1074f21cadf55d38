"""Emulated FP8 recipes (ttrace_core.integrations.fp8): quantization math, GEMMs, autograd, and TP.

The pure tests check the recipe formulas in-process. The distributed test spawns 2 gloo ranks once
(fp8_workers.tp_vs_tp1) and checks that TP2 fp8 layers reproduce the TP1 ones (amax reduced over
TP gives the same scales), that the TP1 layers equal the formulas, and that an unreduced amax
(the fp8-amax-wrong-group bug) makes a difference orders of magnitude above that.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from ttrace_core.integrations import fp8
from ttrace_core.integrations.fp8 import E4M3, E5M2, AmaxHistory, Fp8Quantizers, Fp8Recipe

ROOT = Path(__file__).resolve().parents[2]


def _log_uniform(n: int, low: float, seed: int) -> torch.Tensor:
    """Signed values with magnitudes log-uniform in [low, 1], and amax exactly 1."""
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.exp(torch.rand(n, generator=g) * torch.log(torch.tensor(low)))
    values = magnitude * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    values[0] = 1.0
    return values


# --- quantization ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype, bound, min_normal", [(E4M3, 2 ** -4, 2 ** -6), (E5M2, 2 ** -3, 2 ** -14)])
def test_round_trip_relative_error_is_half_an_ulp(fp8_dtype: torch.dtype, bound: float, min_normal: float) -> None:
    top = torch.finfo(fp8_dtype).max
    t = _log_uniform(20000, min_normal / top, seed=0)  # scaled values span the format's normal range
    q = fp8.quantize_current(t, fp8_dtype)
    assert q.data.dtype == fp8_dtype and q.scale_inv.item() == pytest.approx(1 / top)
    error = ((q.dequantize() - t).abs() / t.abs()).max().item()
    # Round to nearest with 3 (e4m3) or 2 (e5m2) mantissa bits; near the bound, or the format is wrong.
    assert 0.75 * bound < error <= bound


def test_scale_from_amax_and_fallbacks() -> None:
    amax = torch.tensor([2.0, 0.5, 0.0, float("inf")])
    scale = fp8.scale_from_amax(amax, E4M3, fallback=torch.full((4,), 7.0))
    assert scale.tolist() == [224.0, 896.0, 7.0, 7.0]  # 0 or inf amax: keep the previous scale, as TE
    assert fp8.scale_from_amax(torch.tensor(0.0), E5M2).item() == 1.0
    assert fp8.scale_from_amax(torch.tensor(4.0), E5M2).item() == 57344.0 / 4
    assert fp8.quantize(torch.ones(3), E4M3, torch.tensor(4.0)).scale_inv.item() == 0.25


@pytest.mark.parametrize("margin", [0, 1, 2, 3])
def test_margin_halves_the_scale_per_unit(margin: int) -> None:
    amax = torch.tensor(3.0)
    assert fp8.scale_from_amax(amax, E4M3, margin).item() == pytest.approx(448.0 / 3.0 / 2 ** margin, rel=1e-7)
    q = fp8.quantize_current(torch.tensor([3.0, -1.0]), E4M3, margin)
    assert q.data.float().abs().max().item() == 448.0 / 2 ** margin


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_values_beyond_the_range_saturate(fp8_dtype: torch.dtype) -> None:
    top = torch.finfo(fp8_dtype).max
    q = fp8.quantize(torch.tensor([1.0, -10.0, 1e30, 0.5]), fp8_dtype, torch.tensor(top))  # scale fit for amax 1
    assert q.data.float().tolist() == [top, -top, top, top / 2]  # clamped, never inf or NaN


def test_delayed_scaling_uses_history_max_then_rolls() -> None:
    history = AmaxHistory(3, E4M3)
    assert history.scale.item() == 1.0  # TE's initial scale
    for amax, expected_max in [(4.0, 4.0), (1.0, 4.0), (2.0, 4.0), (0.5, 2.0), (0.25, 2.0), (0.1, 0.5)]:
        history.update(torch.tensor(amax))
        assert history.scale.item() == pytest.approx(448.0 / expected_max)
    assert history.history.tolist() == pytest.approx([0.0, 0.25, 0.1])  # [0] is free for the next amax
    history.update(torch.tensor(0.0))
    history.update(torch.tensor(0.0))
    history.update(torch.tensor(0.0))
    assert history.scale.item() == pytest.approx(448.0 / 0.1)  # all-zero history keeps the last scale


def test_delayed_quantizers_cast_with_the_previous_scale() -> None:
    quantizers = Fp8Quantizers(Fp8Recipe(scaling="delayed", amax_history_len=2, margin=1))
    first = quantizers.quantize({"input": torch.tensor([1000.0, 0.3])}, None)["input"]
    assert first.scale_inv.item() == 1.0 and first.data.float().tolist() == [448.0, 0.3125]  # scale 1: saturates
    second = quantizers.quantize({"input": torch.tensor([2.0, 1.0])}, None)["input"]
    assert second.scale_inv.item() == pytest.approx(1000.0 * 2 / 448.0)  # from the first amax, margin 1
    third = quantizers.quantize({"input": torch.tensor([2.0])}, None)["input"]
    assert third.scale_inv.item() == pytest.approx(1000.0 * 2 / 448.0)  # history of 2 still holds 1000
    fourth = quantizers.quantize({"input": torch.tensor([2.0])}, None)["input"]
    assert fourth.scale_inv.item() == pytest.approx(2.0 * 2 / 448.0)  # 1000 rolled out


def test_recipe_validation_and_formats() -> None:
    hybrid, e4m3 = Fp8Recipe(), Fp8Recipe(format="e4m3")
    assert [hybrid.dtype(r) for r in fp8.ROLES] == [E4M3, E4M3, E5M2]
    assert [e4m3.dtype(r) for r in fp8.ROLES] == [E4M3, E4M3, E4M3]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # importing megatron: "Transformer Engine and Apex are not installed"
        assert hybrid.amax_group() is None  # no megatron parallel state here: local amax
    for bad in [dict(scaling="just-in-time"), dict(format="e5m2"), dict(margin=-1), dict(margin=1.5),
                dict(amax_history_len=0), dict(amax_group=None)]:
        with pytest.raises(ValueError):
            Fp8Recipe(**bad)
    with pytest.raises(TypeError):
        Fp8Recipe("delayed")  # keyword-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        hybrid.margin = 2


# --- GEMMs and autograd -----------------------------------------------------------------------------


def _formula_gemm(a: torch.Tensor, b: torch.Tensor, fa: torch.dtype, fb: torch.dtype) -> torch.Tensor:
    def quant(t: torch.Tensor, fdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        amax = t.abs().max().clamp(min=1e-12)
        scale = torch.finfo(fdt).max / amax
        q = (t * scale).clamp(-torch.finfo(fdt).max, torch.finfo(fdt).max).to(fdt)
        return q, (1.0 / scale).float()

    (qa, sa), (qb, sb) = quant(a, fa), quant(b, fb)
    return (qa.float() @ qb.float()) * (sa * sb)


@pytest.mark.parametrize("fb, low, high", [(E4M3, 0.025, 0.05), (E5M2, 0.045, 0.075)])
def test_emulated_gemm_error_and_formula(fb: torch.dtype, low: float, high: float) -> None:
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(128, 256, generator=g), torch.randn(256, 96, generator=g)
    out = fp8.fp8_gemm_emulated(a, b, E4M3, fb, out_dtype=torch.float32)
    assert torch.equal(out, _formula_gemm(a, b, E4M3, fb))
    exact = a.double() @ b.double()
    error = ((out.double() - exact).norm() / exact.norm()).item()
    assert low < error < high  # measured ~0.037 (e4m3 x e4m3) and ~0.058 (e4m3 x e5m2)
    assert fp8.fp8_gemm_emulated(a, b, E4M3, fb).dtype == torch.bfloat16


def _quantized(t: torch.Tensor, fdt: torch.dtype) -> torch.Tensor:
    return fp8.quantize_current(t, fdt).dequantize()


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_linear_function_grads_follow_the_formula(fmt: str) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, 32, generator=g).requires_grad_()
    w, b = torch.randn(24, 32, generator=g).requires_grad_(), torch.randn(24, generator=g).requires_grad_()
    dy = torch.randn(4, 3, 24, generator=g)
    y = fp8.fp8_linear(x, w, b, Fp8Quantizers(Fp8Recipe(format=fmt)))
    y.backward(dy)
    fg = E5M2 if fmt == "hybrid" else E4M3
    x2, dy2 = x.detach().reshape(-1, 32), dy.reshape(-1, 24)
    assert torch.equal(y.detach(), (_formula_gemm(x2, w.detach().t(), E4M3, E4M3) + b.detach()).reshape(4, 3, 24))
    assert torch.equal(x.grad, _formula_gemm(dy2, w.detach(), fg, E4M3).reshape(4, 3, 32))
    assert torch.equal(w.grad, _formula_gemm(dy2.t(), x2, fg, E4M3))
    assert torch.equal(b.grad, dy2.sum(0))  # bias grad from the high-precision grad_output
    plain = x.detach() @ w.detach().t() + b.detach()
    assert (y.detach() - plain).abs().max() > 1e-3  # really quantized


def test_linear_function_keeps_bf16_and_updates_delayed_histories() -> None:
    quantizers = Fp8Quantizers(Fp8Recipe(scaling="delayed", amax_history_len=4))
    x = torch.randn(8, 16, dtype=torch.bfloat16).requires_grad_()
    w = torch.randn(4, 16, dtype=torch.bfloat16).requires_grad_()
    y = fp8.fp8_linear(x, w, None, quantizers)
    y.backward(torch.ones_like(y) * 3)
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16
    h = quantizers.histories
    assert h["input"].history.max().item() == x.detach().abs().max().float().item()
    assert h["weight"].history.max().item() == w.detach().abs().max().float().item()
    assert h["grad_output"].scale.item() == pytest.approx(57344.0 / 3, rel=1e-6)  # grad_output is e5m2 in hybrid


def test_pure_api_imports_without_megatron() -> None:
    code = ("import sys; sys.modules['megatron'] = None\n"
            "import torch; from ttrace_core.integrations import fp8\n"
            "assert fp8.Fp8Recipe().amax_group() is None\n"
            "fp8.fp8_linear(torch.randn(2, 4), torch.randn(3, 4)).sum()\n"
            "try:\n    fp8.Fp8ColumnParallelLinear\nexcept ImportError:\n    print('lazy')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "lazy", result.stderr


# --- megatron specs and layers -------------------------------------------------------------------------


def test_gpt_local_spec_swaps_exactly_the_four_linears() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt_specs = pytest.importorskip("megatron.core.models.gpt.gpt_layer_specs")
    recipe = Fp8Recipe(scaling="delayed")
    original = gpt_specs.get_gpt_layer_local_spec()
    spec = fp8.fp8_gpt_layer_local_spec(recipe)
    attention, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    swapped = {"linear_qkv": (attention.linear_qkv, fp8.Fp8ColumnParallelLinear),
               "linear_proj": (attention.linear_proj, fp8.Fp8RowParallelLinear),
               "linear_fc1": (mlp.linear_fc1, fp8.Fp8ColumnParallelLinear),
               "linear_fc2": (mlp.linear_fc2, fp8.Fp8RowParallelLinear)}
    for name, (sub, cls) in swapped.items():
        assert sub.module is cls and sub.params == {"fp8_recipe": recipe}, name
    assert spec.submodules.self_attention.params == original.submodules.self_attention.params
    assert attention.core_attention is original.submodules.self_attention.submodules.core_attention
    assert original.submodules.mlp.submodules.linear_fc1.__name__ == "ColumnParallelLinear"  # not mutated


# --- distributed: TP2 vs TP1 --------------------------------------------------------------------------

PAIRS = [
    {"name": "current", "scaling": "current", "formula": True},
    {"name": "current_sp", "scaling": "current", "sp": True},
    {"name": "current_e4m3", "scaling": "current", "format": "e4m3", "formula": True},
    {"name": "delayed", "scaling": "delayed", "steps": 3},
    {"name": "delayed_sp", "scaling": "delayed", "sp": True, "steps": 3, "margin": 1},
    {"name": "wrong", "scaling": "current", "wrong_group": True},
    {"name": "wrong_sp", "scaling": "current", "sp": True, "wrong_group": True},
    {"name": "wrong_delayed", "scaling": "delayed", "steps": 3, "wrong_group": True},
]
GPTS = [{"name": "gpt", "scaling": "current", "sp": False}, {"name": "gpt_sp", "scaling": "current", "sp": True},
        {"name": "gpt_wrong", "scaling": "current", "sp": False, "wrong_group": True}]
CLEAN_OF = {"wrong": "current", "wrong_sp": "current_sp", "wrong_delayed": "delayed"}


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("megatron.core")
    from ttrace_core.record.launch import run_ranks

    out = tmp_path_factory.mktemp("fp8") / "results.json"
    run_ranks("tests.integrations.fp8_workers:tp_vs_tp1", {"out": str(out), "pairs": PAIRS, "gpt": GPTS}, 2,
              timeout_s=300)
    return json.loads(out.read_text())


@pytest.mark.distributed
def test_tp1_layers_equal_the_recipe_formulas(tp_results: dict) -> None:
    for name, errors in tp_results["formula"].items():
        assert max(errors.values()) <= 1e-6, f"{name}: megatron fp8 layers differ from the formula: {errors}"


@pytest.mark.distributed
@pytest.mark.parametrize("case", [c["name"] for c in PAIRS if not c.get("wrong_group")])
def test_tp2_pair_matches_tp1(tp_results: dict, case: str) -> None:
    errors = tp_results["pairs"][case]
    # Same scales on every logical tensor: only fp32 summation order differs (measured <= 2.1e-7).
    assert max(errors.values()) <= 1e-5, f"{case}: TP2 vs TP1 relative differences {errors}"
    if case.startswith("delayed"):
        assert all(errors[k] == 0.0 for k in errors if k.endswith(".scale")), errors


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(CLEAN_OF))
def test_wrong_amax_group_is_detectable(tp_results: dict, case: str) -> None:
    wrong, clean = tp_results["pairs"][case], max(tp_results["pairs"][CLEAN_OF[case]].values())
    # measured: clean <= 2.1e-7, wrong output 0.047-0.074 and worst quantity 0.10-0.13
    assert wrong["y"] > max(10 * clean, 1e-2), f"{case}: forward difference {wrong['y']:.3g} vs clean {clean:.3g}"
    assert max(wrong.values()) > max(10 * clean, 3e-2), wrong


@pytest.mark.distributed
def test_gpt_with_fp8_spec_tp2_matches_tp1(tp_results: dict) -> None:
    per_layer = {"mlp.linear_fc1", "mlp.linear_fc2", "self_attention.linear_proj", "self_attention.linear_qkv"}
    assert tp_results["fp8_layers"] == sorted(f"decoder.layers.{i}.{n}" for i in range(2) for n in per_layer)
    gpt = tp_results["gpt"]
    for case in ("gpt", "gpt_sp"):  # measured: loss 9.2e-8, worst grad 6.2e-7
        assert max(gpt[case].values()) <= 1e-5, f"{case}: {gpt[case]}"
    assert gpt["gpt_wrong"]["loss"] > max(10 * gpt["gpt"]["loss"], 1e-4), gpt["gpt_wrong"]  # measured 1.9e-3
