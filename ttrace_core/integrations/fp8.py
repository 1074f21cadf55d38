"""FP8 training recipes by emulation, as drop-in megatron-core ColumnParallelLinear/RowParallelLinear.

TransformerEngine (TE) needs an FP8 GPU; ttrace checks distributed training on CPUs, so the FP8
GEMMs are reproduced numerically: quantize each operand to fp8 with a per-tensor scale, run the
GEMM on the fp8 values (exact in fp32) with fp32 accumulation, and apply both inverse scales to
the result, as cuBLASLt does with TE's ``scale_inv``. The same layers run in the single-rank
reference and in the tensor-parallel (TP) candidate, so ttrace can compare them.

Recipe math (``Fp8Recipe``), per tensor ``t`` of a role (input, weight, grad_output)::

    scale     = fp8_max / amax / 2**margin      # fp8_max: 448 (e4m3), 57344 (e5m2)
    q         = fp8(clamp(t * scale, -fp8_max, fp8_max))   # computed in fp32, round to nearest
    scale_inv = 1 / scale
    y         = (q_x @ q_w^T in fp32) * (scale_inv_x * scale_inv_w)      # + bias, not quantized
    dgrad     = (q_g @ q_w) * (scale_inv_g * scale_inv_w)
    wgrad     = (q_g^T @ q_x) * (scale_inv_g * scale_inv_x)

- ``scaling="current"``: amax is this tensor's own abs-max (TE Float8CurrentScaling).
- ``scaling="delayed"``: the tensor is cast with the scale computed from the max of an amax
  history of earlier calls; its own amax is then recorded and the history rolled (TE DelayedScaling
  with amax_compute_algo="max"; the scale starts at 1 and is kept while the history max is 0).
- ``format="hybrid"``: e4m3 for input and weight, e5m2 for grad_output; ``"e4m3"``: e4m3 everywhere.

Every amax is all-reduced (MAX) over ``recipe.amax_group()`` before use, by default the TP group:
a TP rank holds a shard (or a replica) of the logical tensor, and the reduced amax is that of the
whole tensor, so TP ranks use exactly the scale of the single-rank reference. A wrong group (e.g.
``lambda: None``: each rank's local amax) gives per-shard scales: the ``fp8-amax-wrong-group`` bug.

Emulated vs real TE: the arithmetic of cast, saturation, fp32 accumulation and scale application
is emulated; not emulated are TE's fused kernels' accumulation order (and Hopper's reduced-
precision fp8 accumulation unless TE splits the accumulator), per-block/MX recipes, fp8 weight
caching across micro-batches, the reduction of all amaxes of a step in one buffer over the
DP+TP group, and TE's choice not to reduce weight/grad amaxes for current scaling (see the notes
on ``Fp8Recipe.amax_group``). Under sequence parallel the local input is quantized before an
fp8 (uint8) all-gather, as TE does. Delayed-scaling histories live on the layer (not in its
state_dict) and advance on every forward/backward call, recomputed forwards included.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from ttrace_core.format.naming import FP8_SCALE_MODULE

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
ROLES = ("input", "weight", "grad_output")
_LAYER_NAMES = ("Fp8ColumnParallelLinear", "Fp8RowParallelLinear")


def fp8_max(fp8_dtype: torch.dtype) -> float:
    return float(torch.finfo(fp8_dtype).max)


def default_amax_group() -> ProcessGroup | None:
    """Megatron's TP group once its parallel state is initialized, else None (local amax)."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


@dataclass(frozen=True, kw_only=True)
class Fp8Recipe:
    """How the emulated fp8 layers pick formats and scales (shared by reference and candidate)."""

    scaling: Literal["current", "delayed"] = "current"
    """"current": scale from this tensor's amax; "delayed": from the max of the amax history."""
    format: Literal["hybrid", "e4m3"] = "hybrid"
    """"hybrid": e4m3 forward (input, weight), e5m2 for grad_output; "e4m3": e4m3 for all three."""
    margin: int = 0
    """TE's margin: scale = fp8_max / amax / 2**margin, i.e. each unit halves the scale."""
    amax_history_len: int = 1024
    """Delayed scaling only: how many past amaxes the scale is computed from (TE's default 1024)."""
    amax_group: Callable[[], ProcessGroup | None] = default_amax_group
    """Called at each forward: the group amaxes are all-reduced (MAX) over; None means local amax.

    Default: the TP group, so that every logical tensor gets one scale whatever the TP size.
    (TE reduces the input amax over TP for sequence parallel and, for delayed scaling, all amaxes
    over its DP+TP fp8 group; it leaves weight shards' current-scaling amaxes local. Reducing all
    over TP is what makes the TP candidate bitwise-comparable to the single-rank reference.)
    """

    def __post_init__(self) -> None:
        if self.scaling not in ("current", "delayed"):
            raise ValueError(f"Fp8Recipe.scaling={self.scaling!r}: use 'current' or 'delayed'")
        if self.format not in ("hybrid", "e4m3"):
            raise ValueError(f"Fp8Recipe.format={self.format!r}: use 'hybrid' or 'e4m3'")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"Fp8Recipe.margin={self.margin!r}: must be an int >= 0")
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int) \
                or self.amax_history_len < 1:
            raise ValueError(f"Fp8Recipe.amax_history_len={self.amax_history_len!r}: must be an int >= 1")
        if not callable(self.amax_group):
            raise ValueError("Fp8Recipe.amax_group must be a callable returning a ProcessGroup or None")

    def dtype(self, role: str) -> torch.dtype:
        if role not in ROLES:
            raise ValueError(f"unknown fp8 tensor role {role!r}; expected one of {ROLES}")
        return E5M2 if role == "grad_output" and self.format == "hybrid" else E4M3


# --- pure quantization math -----------------------------------------------------------------------


@dataclass(frozen=True)
class Fp8Tensor:
    """fp8 data and the fp32 inverse scale TE stores beside it (0-dim, or per-row block)."""

    data: torch.Tensor
    scale_inv: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return self.data.float() * self.scale_inv

    def rows(self) -> Fp8Tensor:
        """As a [rows, last dim] matrix, the shape the GEMMs take."""
        data = self.data.reshape(-1, self.data.shape[-1])
        if self.scale_inv.numel() == 1:
            return Fp8Tensor(data, self.scale_inv)
        return Fp8Tensor(data, self.scale_inv.expand(*self.data.shape[:-1], 1).reshape(-1, 1))

    def t(self) -> Fp8Tensor:
        return Fp8Tensor(self.data.t(), self.scale_inv.t() if self.scale_inv.dim() == 2 else self.scale_inv)


def scale_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0,
                    fallback: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_max / amax / 2**margin in fp32; `fallback` (default 1) where amax is 0 or not finite, as TE."""
    amax = amax.float()
    scale = fp8_max(fp8_dtype) / amax / (2.0 ** margin)
    keep = fallback if fallback is not None else torch.ones_like(scale)
    return torch.where((amax > 0) & torch.isfinite(amax), scale, keep)


def quantize(t: torch.Tensor, fp8_dtype: torch.dtype, scale: torch.Tensor) -> Fp8Tensor:
    """Cast t * scale to fp8, saturating: done in fp32 so a bf16 input is not rounded twice."""
    limit = fp8_max(fp8_dtype)
    # Clamp before the cast: e4m3fn saturates on this torch but e5m2 overflows to inf.
    data = (t.detach().float() * scale).clamp(-limit, limit).to(fp8_dtype)
    return Fp8Tensor(data, (1.0 / scale).float())


def quantize_current(t: torch.Tensor, fp8_dtype: torch.dtype = E4M3, margin: int = 0) -> Fp8Tensor:
    """Per-tensor current scaling from t's own amax (no reduction)."""
    return quantize(t, fp8_dtype, scale_from_amax(t.detach().abs().amax(), fp8_dtype, margin))


def fp8_matmul(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b for 2-D fp8 operands with fp32 accumulation, cast to out_dtype."""
    if a.scale_inv.numel() == 1 and b.scale_inv.numel() == 1:
        # fp8 values are exact in fp32; the scales apply once to the sum, as in cuBLASLt.
        out = (a.data.float() @ b.data.float()) * (a.scale_inv * b.scale_inv)
    else:
        # Per-block scales (only after an unreduced amax under SP) cannot be factored out of the sum.
        out = a.dequantize() @ b.dequantize()
    return out.to(out_dtype)


def fp8_gemm_emulated(a: torch.Tensor, b: torch.Tensor, fa: torch.dtype = E4M3, fb: torch.dtype = E4M3,
                      out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """a @ b with both operands current-scaled to fp8 (fa, fb)."""
    return fp8_matmul(quantize_current(a, fa), quantize_current(b, fb), out_dtype)


class AmaxHistory:
    """Delayed-scaling state of one tensor role: amax history and the scale it yields."""

    def __init__(self, length: int, fp8_dtype: torch.dtype, margin: int = 0) -> None:
        self.history = torch.zeros(length)
        self.scale = torch.ones(())  # TE starts at 1 and keeps the scale while no amax was seen
        self.fp8_dtype, self.margin = fp8_dtype, margin

    def update(self, amax: torch.Tensor) -> None:
        """Record the amax of the tensor just cast, then recompute the scale for the next cast."""
        # TE: amax_history[0] holds this step's amax; the scale comes from the max over the whole
        # history, then the history rolls so [0] is free (zeroed) for the next step.
        self.history[0] = amax.float()
        self.scale = scale_from_amax(self.history.max(), self.fp8_dtype, self.margin, fallback=self.scale)
        self.history = torch.roll(self.history, -1)
        self.history[0] = 0.0


class Fp8Quantizers:
    """Per-layer quantization of the three roles under a recipe (holds delayed-scaling state)."""

    def __init__(self, recipe: Fp8Recipe) -> None:
        self.recipe = recipe
        self.histories = ({role: AmaxHistory(recipe.amax_history_len, recipe.dtype(role), recipe.margin)
                           for role in ROLES} if recipe.scaling == "delayed" else {})

    def quantize(self, tensors: dict[str, torch.Tensor], group: ProcessGroup | None) -> dict[str, Fp8Tensor]:
        amaxes = reduced_amaxes(list(tensors.values()), group)
        return {role: self._quantize_one(role, t, amax) for (role, t), amax in zip(tensors.items(), amaxes)}

    def _quantize_one(self, role: str, t: torch.Tensor, amax: torch.Tensor) -> Fp8Tensor:
        fp8_dtype = self.recipe.dtype(role)
        if self.recipe.scaling == "current":
            return quantize(t, fp8_dtype, scale_from_amax(amax, fp8_dtype, self.recipe.margin))
        history = self.histories[role]
        quantized = quantize(t, fp8_dtype, history.scale)  # the scale from *earlier* amaxes
        history.update(amax)
        return quantized


def reduced_amaxes(tensors: list[torch.Tensor], group: ProcessGroup | None) -> torch.Tensor:
    """fp32 amax of each tensor, all-reduced (MAX) over `group` in one call (TE reduces one buffer)."""
    amaxes = torch.stack([t.detach().abs().amax().float() for t in tensors])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
    return amaxes


# --- the linear autograd function -----------------------------------------------------------------


@dataclass(frozen=True)
class _LinearSetup:
    """What one fp8 linear call needs besides its tensors (megatron's communication flags)."""

    quantizers: Fp8Quantizers
    amax_group: ProcessGroup | None
    tp_group: ProcessGroup | None
    sequence_parallel: bool
    allreduce_dgrad: bool
    used_scales: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Filled by the forward: the inverse scale each operand was cast with (before any gather)."""


def _all_gather_fp8(q: Fp8Tensor, group: ProcessGroup) -> Fp8Tensor:
    """Sequence-parallel fp8 all-gather along dim 0 (TE gathers fp8 bytes, not the high-precision input)."""
    from megatron.core.tensor_parallel.mappings import _gather_along_first_dim

    data = _gather_along_first_dim(q.data.view(torch.uint8), group).view(q.data.dtype)
    scales = _gather_along_first_dim(q.scale_inv.reshape(1), group)
    if bool((scales == scales[0]).all()):  # reduced amax: one scale for the gathered tensor
        return Fp8Tensor(data, scales[0])
    # Unreduced amax: keep each rank's scale on its rows (TE would misread them; we stay exact).
    per_row = scales.repeat_interleave(q.data.shape[0]).reshape(-1, *[1] * (q.data.dim() - 1))
    return Fp8Tensor(data, per_row)


def _communicate_dgrad(dgrad: torch.Tensor, setup: _LinearSetup) -> torch.Tensor:
    """Megatron's dgrad communication: reduce-scatter under SP, else all-reduce if asked."""
    if setup.sequence_parallel:
        from megatron.core.tensor_parallel.mappings import _reduce_scatter_along_first_dim

        return _reduce_scatter_along_first_dim(dgrad, setup.tp_group)
    if setup.allreduce_dgrad:
        dist.all_reduce(dgrad, group=setup.tp_group)
    return dgrad


class Fp8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with emulated fp8 GEMMs in forward and backward; megatron's TP communication."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                setup: _LinearSetup) -> torch.Tensor:
        q = setup.quantizers.quantize({"input": input, "weight": weight}, setup.amax_group)
        setup.used_scales.update(input=q["input"].scale_inv, weight=q["weight"].scale_inv)
        q_input = _all_gather_fp8(q["input"], setup.tp_group) if setup.sequence_parallel else q["input"]
        out = fp8_matmul(q_input.rows(), q["weight"].t(), input.dtype)
        out = out.reshape(*q_input.data.shape[:-1], weight.shape[0])
        if bias is not None:
            out = out + bias  # bias stays in high precision, as in TE
        # Saved in fp8 (TE saves the quantized input and weight for backward).
        ctx.q_input, ctx.q_weight, ctx.setup = q_input, q["weight"], setup
        ctx.input_dtype, ctx.weight_dtype, ctx.has_bias = input.dtype, weight.dtype, bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        setup: _LinearSetup = ctx.setup
        q_grad = setup.quantizers.quantize({"grad_output": grad_output}, setup.amax_group)["grad_output"].rows()
        dgrad = fp8_matmul(q_grad, ctx.q_weight, ctx.input_dtype).reshape(ctx.q_input.data.shape)
        dgrad = _communicate_dgrad(dgrad, setup)
        wgrad = fp8_matmul(q_grad.t(), ctx.q_input.rows(), ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        bgrad = grad_output.reshape(-1, grad_output.shape[-1]).sum(0) if ctx.has_bias else None
        return dgrad, wgrad, bgrad, None


def fp8_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               quantizers: Fp8Quantizers | None = None) -> torch.Tensor:
    """Single-device input @ weight^T + bias with fp8 GEMMs (no TP communication).

    Pass the same `quantizers` on every call for delayed scaling (they hold the amax histories).
    Amaxes are still reduced over `quantizers.recipe.amax_group()` (the TP group once megatron's
    parallel state exists); pass a recipe with `amax_group=lambda: None` for purely local scales.
    """
    quantizers = quantizers if quantizers is not None else Fp8Quantizers(Fp8Recipe())
    setup = _LinearSetup(quantizers, quantizers.recipe.amax_group(), None, False, False)
    return Fp8LinearFunction.apply(input, weight, bias, setup)


# --- megatron layers and specs (megatron imported lazily) ---------------------------------------


class Fp8ScaleInv(torch.nn.Module):
    """Identity on the inverse scales a linear's input and weight were cast with, so that a tracer
    hooked on modules records them: every TP rank must use the scale of the whole logical tensor,
    i.e. the reference's, so a scale that differs is a quantization bug seen where it starts."""

    def forward(self, input_scale_inv: torch.Tensor, weight_scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return input_scale_inv.detach().reshape(1), weight_scale_inv.detach().reshape(1)


class _Fp8LinearMixin:
    """Replaces megatron's `_forward_impl` GEMM; everything around it (copy/reduce/scatter) is megatron's."""

    tp_group: ProcessGroup | None

    def __init__(self, *args: Any, fp8_recipe: Fp8Recipe | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fp8_recipe = fp8_recipe if fp8_recipe is not None else Fp8Recipe()
        self.fp8_quantizers = Fp8Quantizers(self.fp8_recipe)
        self.add_module(FP8_SCALE_MODULE, Fp8ScaleInv())  # recorded as "<linear>.fp8_scale_inv"

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      gradient_accumulation_fusion: bool, allreduce_dgrad: bool, sequence_parallel: bool,
                      grad_output_buffer: list | None = None, wgrad_deferral_limit: int | None = None,
                      tp_group: ProcessGroup | None = None) -> torch.Tensor:
        if gradient_accumulation_fusion or grad_output_buffer is not None:
            raise NotImplementedError("fp8 emulation: set gradient_accumulation_fusion=False and "
                                      "defer_embedding_wgrad_compute=False (weight grads go to .grad)")
        setup = _LinearSetup(self.fp8_quantizers, self.fp8_recipe.amax_group(),
                             tp_group if tp_group is not None else self.tp_group,
                             sequence_parallel, allreduce_dgrad)
        output = Fp8LinearFunction.apply(input, weight, bias, setup)
        self.get_submodule(FP8_SCALE_MODULE)(setup.used_scales["input"], setup.used_scales["weight"])
        return output


@functools.cache
def _layer_classes() -> dict[str, type]:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    class Fp8ColumnParallelLinear(_Fp8LinearMixin, ColumnParallelLinear):
        """ColumnParallelLinear with emulated fp8 GEMMs; extra keyword `fp8_recipe`."""

    class Fp8RowParallelLinear(_Fp8LinearMixin, RowParallelLinear):
        """RowParallelLinear with emulated fp8 GEMMs; extra keyword `fp8_recipe`."""

    classes = {"Fp8ColumnParallelLinear": Fp8ColumnParallelLinear, "Fp8RowParallelLinear": Fp8RowParallelLinear}
    for name, cls in classes.items():
        cls.__module__, cls.__qualname__ = __name__, name  # picklable as fp8.<name>
    return classes


def __getattr__(name: str) -> type:
    # Fp8ColumnParallelLinear / Fp8RowParallelLinear subclass megatron's layers, so they are built
    # on first access: the rest of this module imports without megatron.
    if name in _LAYER_NAMES:
        return _layer_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def fp8_spec(spec: Any, recipe: Fp8Recipe) -> Any:
    """A copy of a megatron ModuleSpec tree with every Column/RowParallelLinear made fp8."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    swaps = {ColumnParallelLinear: _layer_classes()["Fp8ColumnParallelLinear"],
             RowParallelLinear: _layer_classes()["Fp8RowParallelLinear"]}
    return _swap(spec, swaps, recipe)


def _swap(node: Any, swaps: dict[type, type], recipe: Fp8Recipe) -> Any:
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(node, type):  # a bare class: wrap it so build_module passes the recipe
        return ModuleSpec(module=swaps[node], params={"fp8_recipe": recipe}) if node in swaps else node
    if isinstance(node, ModuleSpec):
        submodules = _swap(node.submodules, swaps, recipe)
        if node.module in swaps:
            return dataclasses.replace(node, module=swaps[node.module], submodules=submodules,
                                       params={**node.params, "fp8_recipe": recipe})
        return dataclasses.replace(node, submodules=submodules)
    if dataclasses.is_dataclass(node):  # a *Submodules dataclass
        fields = [f.name for f in dataclasses.fields(node) if f.init]
        return dataclasses.replace(node, **{name: _swap(getattr(node, name), swaps, recipe) for name in fields})
    return node


def fp8_gpt_layer_local_spec(recipe: Fp8Recipe, **spec_kwargs: Any) -> Any:
    """get_gpt_layer_local_spec(**spec_kwargs) with linear_qkv/proj/fc1/fc2 as fp8 layers."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return fp8_spec(get_gpt_layer_local_spec(**spec_kwargs), recipe)
