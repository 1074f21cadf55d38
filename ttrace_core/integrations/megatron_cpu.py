"""Run megatron-core 0.16.1's local (non-TransformerEngine) path on CPU ranks with gloo.

Megatron-core assumes a GPU in places where the arithmetic does not need one: it passes
``torch.cuda.current_device()`` as a device, writes ``device="cuda"`` literals, keeps dropout
RNG state in the CUDA generator, and checks ``Tensor.type()`` for ``torch.cuda.*`` names.
ttrace checks training for silent numerical bugs on CPU machines (CI has no GPU), so
``enable()`` redirects exactly those calls to the CPU. It changes no arithmetic: every op runs
the same kernels megatron's own code would call on CPU tensors; only devices, RNG bookkeeping,
stream/sync calls and type-name checks are redirected. When CUDA is available it does nothing.

Usage, in every rank before building models::

    from ttrace_core.integrations import megatron_cpu
    megatron_cpu.enable()   # True if it patched; False (a no-op) when CUDA is available
    megatron_cpu.disable()  # restores every original (for tests)

Patches (megatron/core file:function that needs it -> what is redirected):

Global ``torch`` attributes (there is no CUDA device on such a machine that they could serve):

- ``torch.cuda.current_device`` -> ``torch.device("cpu")``: utils.py GlobalMemoryBuffer.get_tensor;
  tensor_parallel/mappings.py _gather_along_first_dim, _reduce_scatter_along_first_dim;
  tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication.backward;
  pipeline_parallel/p2p_communication.py create_tensor_recv_prev/next, _communicate;
  distributed/param_and_grad_buffer.py _ParamAndGradBuffer.__init__.
- ``torch.cuda.synchronize/Stream/Event/stream/current_stream/default_stream`` -> no-ops:
  p2p_communication.py _communicate; distributed_data_parallel.py and param_and_grad_buffer.py
  (streams of multi-instance distributed optimizers); transformer/moe/token_dispatcher.py
  MoEAlltoAllTokenDispatcher (its device-to-host copy stream and the event it waits on).
- ``torch.cuda.manual_seed/get_rng_state/set_rng_state/default_generators`` -> the CPU default
  generator: tensor_parallel/random.py model_parallel_cuda_manual_seed, CudaRNGStatesTracker.add;
  rerun_state_machine.py.
- ``torch.Tensor.cuda`` -> returns the tensor itself: models/common/language_module/
  language_module.py setup_embeddings_and_output_layer (tied embeddings under PP), utils.py.

Megatron attributes:

- tensor_parallel/random.py ``_get_cuda_rng_state``, ``_set_cuda_rng_state`` -> CPU default
  generator: CudaRNGStatesTracker.add/fork, CheckpointFunction.
- transformer/torch_norm.py ``WrappedTorchNorm.__new__`` -> same torch LayerNorm/RMSNorm, but
  also under sequence parallel, with params tagged ``.sequence_parallel`` so that
  finalize_model_grads all-reduces their grads over TP (what apex's FusedLayerNorm does).
- module-level ``torch`` replaced by a proxy whose factories map ``device="cuda"`` to the CPU in:
  pipeline_parallel/schedules.py forward_backward_no_pipelining, _pipelining_without_interleaving,
  _pipelining_with_interleaving; optimizer/optimizer.py MixedPrecisionOptimizer.__init__,
  FP32Optimizer.__init__; optimizer/clip_grads.py get_grad_norm_fp32, clip_grad_by_total_norm_fp32,
  count_zeros_fp32; optimizer/grad_scaler.py scaler __init__s; utils.py local_multi_tensor_l2_norm;
  transformer/utils.py get_default_causal_mask (attention_mask=None).
- ``Tensor.type()`` reports ``torch.cuda.*`` names for CPU tensors, only while these run:
  optimizer/optimizer.py Float16OptimizerWithFloat16Params.__init__; optimizer/distrib_optimizer.py
  DistributedOptimizer.__init__; optimizer/clip_grads.py clip_grad_by_total_norm_fp32 (also its
  copy imported into optimizer/optimizer.py).
- transformer/moe/token_dispatcher.py ``maybe_move_tensor_to_cpu`` -> returns host tensors as numpy
  arrays when asked, as it does for device tensors (the alltoall dispatcher's split sizes).
- transformer/moe/moe_utils.py ``te_general_gemm`` -> None when TransformerEngine is absent (the
  MoE router reads it; megatron binds it only when TE imports).
- a logging filter on tensor_parallel/random.py's logger drops "CPU RNG state changed within GPU
  RNG context", which CudaRNGStatesTracker.fork would log for every random op it forks, because
  here the "GPU" generator is the CPU one.

Side effect to know: ``model_parallel_cuda_manual_seed(seed)`` reseeds the CPU default generator
(on a GPU it would reseed the CUDA one), so with ``use_cpu_initialization=True`` the initial
weights depend on that seed, identically on every TP rank and for every TP size.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ttrace_core.integrations.patching import patch_attribute

_MISSING = object()
_UNDO: list[Callable[[], None]] = []
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange")
# The megatron.core modules whose functions write device="cuda" literals (see the docstring).
_PROXIED_MODULES = (
    "pipeline_parallel.schedules",
    "optimizer.optimizer",
    "optimizer.clip_grads",
    "optimizer.grad_scaler",
    "utils",
    "transformer.utils",
)
_FORK_WARNING = "CPU RNG state changed within GPU RNG context"


def enable() -> bool:
    """Patch megatron-core for CPU; idempotent. Returns False (and patches nothing) under CUDA."""
    if torch.cuda.is_available():
        return False
    if _UNDO:
        return True
    try:
        _patch_torch_cuda()
        _patch_megatron()
    except BaseException:
        disable()
        raise
    return True


def disable() -> bool:
    """Restore every original attribute; returns whether anything was patched."""
    was_enabled = bool(_UNDO)
    while _UNDO:
        _UNDO.pop()()
    return was_enabled


def is_enabled() -> bool:
    return bool(_UNDO)


# --- patch bookkeeping -------------------------------------------------------------------------


def _set(owner: Any, name: str, value: Any) -> None:
    """Set `owner.name` and record how to undo it."""
    _UNDO.append(patch_attribute(owner, name, value))


def _megatron(module: str) -> types.ModuleType:
    try:
        return importlib.import_module(f"megatron.core.{module}")
    except ImportError as error:
        raise ValueError(f"megatron_cpu.enable(): cannot import megatron.core.{module} ({error}); "
                         "install megatron-core==0.16.1 or do not call enable()") from error


def _attr(owner: Any, name: str) -> Any:
    """Fetch what we are about to wrap; a missing name means a megatron-core this was not written for."""
    if not hasattr(owner, name):
        version = getattr(_megatron("package_info"), "__version__", "unknown")
        raise ValueError(f"megatron_cpu.enable(): {getattr(owner, '__name__', owner)} has no '{name}' "
                         f"(written for megatron-core 0.16.1, found {version}); pin megatron-core==0.16.1 "
                         "or update ttrace_core/integrations/megatron_cpu.py")
    return getattr(owner, name)


# --- torch.cuda ---------------------------------------------------------------------------------


class _NullStream:
    """Stands in for torch.cuda.Stream/Event: CPU ops are synchronous, so waiting is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Callable[..., None]:
        # wait_stream, wait_event, record, synchronize, query...: all no-ops.
        return lambda *args, **kwargs: None

    def record_event(self, *args: Any, **kwargs: Any) -> _NullStream:
        """An event that is already complete: the alltoall token dispatcher synchronizes on it
        (token_dispatcher.py MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize)."""
        return _NullStream()


def _null_stream(*args: Any, **kwargs: Any) -> _NullStream:
    return _NullStream()


def _null_stream_context(*args: Any, **kwargs: Any) -> contextlib.nullcontext:
    return contextlib.nullcontext()


def _cpu_manual_seed(seed: int) -> None:
    # Not torch.manual_seed: that reseeds every device, and megatron means the one generator it forks.
    torch.default_generator.manual_seed(int(seed))


def _cpu_get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.default_generator.get_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.default_generator.set_state(new_state)


def _tensor_self(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


def _patch_torch_cuda() -> None:
    replacements: dict[str, Any] = {
        # Megatron passes the result as `device=`, so a torch.device works where an index would not.
        "current_device": lambda: torch.device("cpu"),
        "synchronize": lambda *args, **kwargs: None,
        "Stream": _NullStream,
        "Event": _NullStream,
        "stream": _null_stream_context,
        "current_stream": _null_stream,
        "default_stream": _null_stream,
        "manual_seed": _cpu_manual_seed,
        "get_rng_state": _cpu_get_rng_state,
        "set_rng_state": _cpu_set_rng_state,
        "default_generators": (torch.default_generator,),
    }
    for name, value in replacements.items():
        _set(torch.cuda, name, value)
    _set(torch.Tensor, "cuda", _tensor_self)


# --- megatron -----------------------------------------------------------------------------------


def _patch_megatron() -> None:
    moe_utils = _megatron("transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        # The MoE router reads this name, which megatron binds only when TransformerEngine imports;
        # None selects its torch path.
        _set(moe_utils, "te_general_gemm", None)
    # The alltoall dispatcher turns its split sizes into host lists at its device-to-host point; for
    # a tensor already on the host megatron's helper leaves it a tensor, which gloo's all_to_all refuses.
    _set(_megatron("transformer.moe.token_dispatcher"), "maybe_move_tensor_to_cpu", _host_values)
    _patch_rng_helpers(_megatron("tensor_parallel.random"))
    _patch_torch_norm(_megatron("transformer.torch_norm"))
    for name in _PROXIED_MODULES:
        module = _megatron(name)
        _attr(module, "torch")
        _set(module, "torch", _CpuTorch("torch"))
    _patch_type_checks()


def _host_values(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """moe_utils.maybe_move_tensor_to_cpu for host tensors: as a numpy array when asked, as on a GPU."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _graph_safe_error(graph_safe: bool) -> None:
    if graph_safe:
        raise ValueError("megatron_cpu: a CUDA-graph-safe RNG tracker was requested but this is a CPU run; "
                         "pass use_cudagraphable_rng=False (the default) to model_parallel_cuda_manual_seed")


def _get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    _graph_safe_error(graph_safe)
    return torch.default_generator.get_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    _graph_safe_error(graph_safe)
    torch.default_generator.set_state(new_state)


class _ForkWarningFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _FORK_WARNING


def _patch_rng_helpers(random_module: types.ModuleType) -> None:
    # The tracker swaps whole generator states in and out; pointing it at the CPU default generator
    # keeps megatron's semantics (TP-rank-specific dropout inside fork(), shared outside) for CPU ops.
    _attr(random_module, "_get_cuda_rng_state")
    _attr(random_module, "_set_cuda_rng_state")
    _set(random_module, "_get_cuda_rng_state", _get_cpu_rng_state)
    _set(random_module, "_set_cuda_rng_state", _set_cpu_rng_state)
    logger, log_filter = logging.getLogger(random_module.__name__), _ForkWarningFilter()
    logger.addFilter(log_filter)
    _UNDO.append(lambda: logger.removeFilter(log_filter))


def _torch_norm_new(cls: type, config: Any, hidden_size: int, eps: float = 1e-5,
                    persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                    normalization: str = "LayerNorm") -> torch.nn.Module:
    """WrappedTorchNorm.__new__ without its `not config.sequence_parallel` assertion.

    Keeps megatron's signature; like the original it reads the config, not the last three arguments.
    """
    for flag in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
        if getattr(config, flag, False):
            raise ValueError(f"WrappedTorchNorm (megatron local spec): TransformerConfig.{flag}=True is not "
                             f"supported by torch's norms; set {flag}=False")
    norm_classes = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
    if config.normalization not in norm_classes:
        raise ValueError(f"WrappedTorchNorm (megatron local spec): normalization={config.normalization!r} is "
                         f"not supported on CPU; use one of {sorted(norm_classes)}")
    norm = norm_classes[config.normalization](normalized_shape=hidden_size, eps=eps)
    # Under SP each TP rank normalizes its own sequence slice, so these grads are partial sums:
    # finalize_model_grads all-reduces params tagged like this over TP, as FusedLayerNorm tags them.
    for param in norm.parameters():
        param.sequence_parallel = config.sequence_parallel
    return norm


def _patch_torch_norm(norm_module: types.ModuleType) -> None:
    wrapped = _attr(norm_module, "WrappedTorchNorm")
    _set(wrapped, "__new__", staticmethod(_torch_norm_new))


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":")[0] == "cuda"


def _cpu_factory(name: str) -> Callable[..., torch.Tensor]:
    @functools.wraps(getattr(torch, name))
    def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return getattr(torch, name)(*args, **kwargs)

    return factory


_CPU_FACTORIES = {name: _cpu_factory(name) for name in _FACTORIES}


class _CpuTorch(types.ModuleType):
    """`torch` as one megatron module sees it: factories put `device="cuda"` tensors on the CPU.

    Scoped to the module globals of the few files with "cuda" literals instead of a global
    TorchFunctionMode (~3.6 us on every torch call): only `torch.<name>` lookups in those files
    pay, ~0.1 us each. __getattribute__ rather than __getattr__ because a failed module lookup
    builds an AttributeError first (~1.9 us); nothing is cached, so later patches of torch stay visible.
    """

    def __getattribute__(self, name: str) -> Any:
        factory = _CPU_FACTORIES.get(name)
        return factory if factory is not None else getattr(torch, name)


def _cuda_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> str | torch.Tensor:
    if args or kwargs:  # Tensor.type(dtype) converts; only the name query is redirected
        return torch._C.TensorBase.type(self, *args, **kwargs)
    name = torch._C.TensorBase.type(self)
    return name.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else name


@contextlib.contextmanager
def _cuda_type_names() -> Iterator[None]:
    """Report CPU tensors' type() as torch.cuda.* inside; nests, and restores whatever was there."""
    previous = vars(torch.Tensor).get("type", _MISSING)
    torch.Tensor.type = _cuda_type
    try:
        yield
    finally:
        if previous is _MISSING:
            del torch.Tensor.type
        else:
            torch.Tensor.type = previous


def _with_cuda_type_names(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _cuda_type_names():
            return function(*args, **kwargs)

    return wrapper


def _patch_type_checks() -> None:
    # Scoped, not global: elsewhere type() names feed dtype/device decisions that must see the truth.
    # (Tensor.type is a class attribute, so other threads see the CUDA names during these calls too.)
    optimizer, clip_grads = _megatron("optimizer.optimizer"), _megatron("optimizer.clip_grads")
    distrib = _megatron("optimizer.distrib_optimizer")
    for cls in (_attr(optimizer, "Float16OptimizerWithFloat16Params"), _attr(distrib, "DistributedOptimizer")):
        _set(cls, "__init__", _with_cuda_type_names(_attr(cls, "__init__")))
    clip = _with_cuda_type_names(_attr(clip_grads, "clip_grad_by_total_norm_fp32"))
    # optimizer.py did `from .clip_grads import clip_grad_by_total_norm_fp32`: patch both names.
    _set(clip_grads, "clip_grad_by_total_norm_fp32", clip)
    _set(optimizer, "clip_grad_by_total_norm_fp32", clip)
