"""Functions run on spawned gloo ranks by test_fp8.py. A failed assertion fails the rank.

`tp_vs_tp1` runs every case on TP2 first (one parallel-state setup), then the same cases as a
single-rank TP1 reference in the same ranks with the same full weights, and rank 0 writes the
relative differences to config["out"] as JSON for the test to assert on and report.
"""

from __future__ import annotations

import json
import time
import warnings

import torch
import torch.distributed as dist

from ttrace_core.integrations import fp8, megatron_cpu

RANK_IMPORTS = ("megatron.core", "megatron.core.models.gpt", "megatron.core.distributed", "megatron.core.optimizer",
                "megatron.core.pipeline_parallel")
"""What these ranks import (record/launch.py imports it once, before it forks them)."""

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|CUDA_DEVICE_MAX_CONNECTIONS).*")

SEED = 1234
SEQ, BATCH, HIDDEN, FFN = 8, 2, 64, 128
VOCAB = 128


def _start() -> None:
    assert megatron_cpu.enable(), "enable() must patch on a machine without CUDA"
    dist.init_process_group("gloo")


def _parallel(tp: int) -> None:
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)


def _config(tp: int, sp: bool, layers: int = 1):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=layers, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=4,
        use_cpu_initialization=True, tensor_model_parallel_size=tp, sequence_parallel=sp,
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False)


def _recipe(spec: dict) -> fp8.Fp8Recipe:
    wrong = spec.get("wrong_group", False)
    extra = {"amax_group": (lambda: None)} if wrong else {}  # each rank's local amax: the bug
    return fp8.Fp8Recipe(scaling=spec["scaling"], format=spec.get("format", "hybrid"),
                         margin=spec.get("margin", 0), amax_history_len=spec.get("history", 4), **extra)


def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _shard(full: torch.Tensor, dim: int) -> torch.Tensor:
    rank, size = _tp()
    return full.chunk(size, dim=dim)[rank].contiguous()


def _gather(local: torch.Tensor, dim: int) -> torch.Tensor:
    from megatron.core import parallel_state

    rank, size = _tp()
    if size == 1:
        return local.detach().clone()
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.detach().contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


# --- a ColumnParallelLinear -> RowParallelLinear fp8 pair ----------------------------------------


def _full_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    return {"col.weight": torch.randn(FFN, HIDDEN, generator=g) / HIDDEN ** 0.5,
            "col.bias": torch.randn(FFN, generator=g) * 0.1,
            "row.weight": torch.randn(HIDDEN, FFN, generator=g) / FFN ** 0.5,
            "row.bias": torch.randn(HIDDEN, generator=g) * 0.1}


def _pair(recipe: fp8.Fp8Recipe, tp: int, sp: bool) -> torch.nn.ModuleDict:
    config, init = _config(tp, sp), torch.nn.init.zeros_
    col = fp8.Fp8ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=init, bias=True,
                                      gather_output=False, fp8_recipe=recipe)
    row = fp8.Fp8RowParallelLinear(FFN, HIDDEN, config=config, init_method=init, bias=True,
                                   input_is_parallel=True, skip_bias_add=False, fp8_recipe=recipe)
    full = _full_weights()
    with torch.no_grad():  # same full weights for every TP size: load this rank's shards
        col.weight.copy_(_shard(full["col.weight"], 0))
        col.bias.copy_(_shard(full["col.bias"], 0))
        row.weight.copy_(_shard(full["row.weight"], 1))
        row.bias.copy_(full["row.bias"])
    return torch.nn.ModuleDict({"col": col, "row": row})


def _pair_step(pair: torch.nn.ModuleDict, sp: bool, step: int) -> dict[str, torch.Tensor]:
    """One forward/backward of row(gelu(col(x))) with loss sum(y * g); full tensors of everything."""
    from megatron.core import parallel_state

    g = torch.Generator().manual_seed(100 + step)
    x_full, dy_full = torch.randn(SEQ, BATCH, HIDDEN, generator=g) * 2.0, torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    x = (_shard(x_full, 0) if sp else x_full.clone()).requires_grad_()
    hidden, _ = pair["col"](x)
    y, _ = pair["row"](torch.nn.functional.gelu(hidden))
    (y * (_shard(dy_full, 0) if sp else dy_full)).sum().backward()
    if sp:  # the row bias saw only this rank's sequence slice (finalize_model_grads sums these)
        dist.all_reduce(pair["row"].bias.grad, group=parallel_state.get_tensor_model_parallel_group())
    out = {"y": _gather(y, 0) if sp else y.detach(), "x.grad": _gather(x.grad, 0) if sp else x.grad,
           "col.weight.grad": _gather(pair["col"].weight.grad, 0), "col.bias.grad": _gather(pair["col"].bias.grad, 0),
           "row.weight.grad": _gather(pair["row"].weight.grad, 1), "row.bias.grad": pair["row"].bias.grad.clone()}
    pair.zero_grad(set_to_none=True)
    return out


def _run_pair(spec: dict, tp: int) -> list[dict[str, torch.Tensor]]:
    sp = spec.get("sp", False) and tp > 1
    pair = _pair(_recipe(spec), tp, sp)
    steps = [_pair_step(pair, sp, step) for step in range(spec.get("steps", 1))]
    if spec["scaling"] == "delayed":  # the histories' scales must agree with TP1 too
        steps[-1].update({f"{name}.{role}.scale": h.scale.reshape(1) for name in ("col", "row")
                          for role, h in pair[name].fp8_quantizers.histories.items()})
    return steps


def _quant(t: torch.Tensor, fdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Current scaling written out independently of fp8.py (the recipe's formula)."""
    amax = t.abs().max().clamp(min=1e-12)
    scale = torch.finfo(fdt).max / amax
    q = (t * scale).clamp(-torch.finfo(fdt).max, torch.finfo(fdt).max).to(fdt)
    return q.float(), (1.0 / scale).float()


def _mm(a: torch.Tensor, fa: torch.dtype, b: torch.Tensor, fb: torch.dtype) -> torch.Tensor:
    (qa, sa), (qb, sb) = _quant(a, fa), _quant(b, fb)
    return (qa @ qb) * (sa * sb)


def _formula_pair(spec: dict, step: int = 0) -> dict[str, torch.Tensor]:
    """The pair's forward and backward from the recipe formulas, on full tensors (TP1, current scaling)."""
    fwd = torch.float8_e4m3fn
    bwd = torch.float8_e5m2 if spec.get("format", "hybrid") == "hybrid" else fwd
    w, g = _full_weights(), torch.Generator().manual_seed(100 + step)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g).mul(2.0).reshape(-1, HIDDEN)  # as _pair_step draws them
    dy = torch.randn(SEQ * BATCH, HIDDEN, generator=g)
    h = (_mm(x, fwd, w["col.weight"].t(), fwd) + w["col.bias"]).requires_grad_()
    a = torch.nn.functional.gelu(h)
    y = _mm(a.detach(), fwd, w["row.weight"].t(), fwd) + w["row.bias"]
    da = _mm(dy, bwd, w["row.weight"], fwd)
    (dh,) = torch.autograd.grad(a, h, da)
    full = lambda t: t.reshape(SEQ, BATCH, -1)  # noqa: E731
    return {"y": full(y), "x.grad": full(_mm(dh, bwd, w["col.weight"], fwd)),
            "col.weight.grad": _mm(dh.t(), bwd, x, fwd), "col.bias.grad": dh.sum(0),
            "row.weight.grad": _mm(dy.t(), bwd, a.detach(), fwd), "row.bias.grad": dy.sum(0)}


# --- a GPT model built from fp8_gpt_layer_local_spec -----------------------------------------------


def _gpt(recipe: fp8.Fp8Recipe, tp: int, sp: bool):
    from megatron.core.models.gpt import GPTModel

    spec = fp8.fp8_gpt_layer_local_spec(recipe)
    return GPTModel(_config(tp, sp, layers=2), spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def _gpt_step(model, sp: bool) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state

    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    loss = model(tokens[:, :-1].contiguous(), positions, None, labels=tokens[:, 1:].contiguous())
    loss.mean().backward()
    out = {"loss": loss.detach()}
    for name, param in model.named_parameters():
        if sp and getattr(param, "sequence_parallel", False):
            dist.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())
        dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
        out[f"{name}.grad"] = param.grad.clone() if dim is None else _gather(param.grad, dim)
    return out


def _full_params(model) -> dict[str, torch.Tensor]:
    return {name: _gather(p, p.partition_dim) if getattr(p, "tensor_model_parallel", False) else p.detach().clone()
            for name, p in model.named_parameters()}


def _fp8_layer_names(model) -> list[str]:
    return sorted(name for name, module in model.named_modules()
                  if isinstance(module, (fp8.Fp8ColumnParallelLinear, fp8.Fp8RowParallelLinear)))


# --- comparison -------------------------------------------------------------------------------------


def _relative(candidate: list[dict], reference: list[dict]) -> dict[str, float]:
    """max |candidate - reference| / max |reference| per quantity (worst step)."""
    worst: dict[str, float] = {}
    for got, want in zip(candidate, reference, strict=True):
        for name, value in want.items():
            error = (got[name] - value).abs().max().item() / max(value.abs().max().item(), 1e-30)
            worst[name] = max(worst.get(name, 0.0), error)
    return worst


def tp_vs_tp1(config: dict) -> None:
    """Every case in config["pairs"] and config["gpt"] on TP2, then on TP1; rank 0 writes the diffs."""
    _start()
    try:
        started = time.monotonic()
        _parallel(tp=2)
        pairs = {spec["name"]: _run_pair(spec, tp=2) for spec in config["pairs"]}
        gpts, gpt_params, swapped = {}, {}, []
        for spec in config["gpt"]:
            model = _gpt(_recipe(spec), tp=2, sp=spec["sp"])
            swapped = _fp8_layer_names(model)
            gpt_params[spec["name"]] = _full_params(model)
            gpts[spec["name"]] = [_gpt_step(model, spec["sp"])]
        _parallel(tp=1)
        references = {spec["name"]: _run_pair({**spec, "sp": False, "wrong_group": False}, tp=1)
                      for spec in config["pairs"]}
        results = {"pairs": {name: _relative(runs, references[name]) for name, runs in pairs.items()},
                   "gpt": {}, "fp8_layers": swapped,
                   "formula": {spec["name"]: _relative(references[spec["name"]][:1], [_formula_pair(spec)])
                               for spec in config["pairs"] if spec.get("formula")}}
        for spec in config["gpt"]:
            model = _gpt(_recipe({**spec, "wrong_group": False}), tp=1, sp=False)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(gpt_params[spec["name"]][name])
            results["gpt"][spec["name"]] = _relative(gpts[spec["name"]], [_gpt_step(model, False)])
        results["seconds"] = time.monotonic() - started
        if dist.get_rank() == 0:
            with open(config["out"], "w") as handle:
                json.dump(results, handle, indent=1)
    finally:
        dist.destroy_process_group()
