"""torchtitan 0.3.0's debug configurations, unchanged but for what a CPU cannot run and where the data is.

torchtitan loads this module by `--module ttrace_examples.torchtitan --config NAME` (its ConfigManager
imports `<module>.config_registry` and calls NAME()); every other setting comes from torchtitan's own
registry function of the same name and can be overridden on the command line as usual.

Five changes, each for a reason the CPU, this machine or the trace imposes:
- attention: language models use FlexAttention, whose backward PyTorch does not implement on CPU
  ("FlexAttention does not support backward on CPU"), or varlen attention, which is bf16 and CUDA only.
  The inner attention becomes torchtitan's ScaledDotProductAttention (causal over the packed
  sequence: documents inside one sequence are not masked from each other, as before torchtitan had
  per-document masks). The projections, RoPE, TP plan and everything around them are torchtitan's.
- data: the dataset is `c4_test` read from assets/c4_test (a stand-in; the wheel does not ship
  torchtitan's tests/assets), the tokenizer a byte-level BPE trained on it (assets/make_tokenizer.py),
  with torchtitan's BOS and EOS as special tokens.
- checkpointing and validation are off: a trace is one or two steps and must not load a checkpoint
  left by another run.
- CUDA graphs are off (`training.disable_cuda_graphs`): there are none on CPU, and torchtitan refuses
  pipeline parallelism while they are on.
- `parallelism.spmd_backend` is "partial_dtensor" (DTensor on the model-parallel axes only): ttrace
  reads layouts from DTensors. torchtitan's default "spmd_types" keeps parameters and activations as
  plain local tensors with spmd_types annotations that ttrace does not read (and with tensor
  parallelism its fully_shard call fails here: "all parameters must be DTensors on the full SPMD
  mesh ... Got plain tensor"); "full_dtensor" also makes the activations DTensors sharded over the
  data-parallel mesh, so one logical activation is the whole global batch, which contradicts the
  micro-batch rule (local micro-batch k of data-parallel rank r is the reference's k * dp + r).
  It works for tensor parallelism alone; pass `--parallelism.spmd_backend full_dtensor` to try it.
"""

from __future__ import annotations

from pathlib import Path

from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention
from torchtitan.models.deepseek_v3 import config_registry as deepseek_v3_registry
from torchtitan.models.llama3 import config_registry as llama3_registry
from torchtitan.models.qwen3 import config_registry as qwen3_registry
from torchtitan.trainer import Trainer

ASSETS = Path(__file__).resolve().parent / "assets"


def traceable_on_cpu(config: Trainer.Config) -> Trainer.Config:
    """`config` with causal SDPA attention, the generated tokenizer and data, no checkpoint and no validation."""
    masked = (FlexAttention.Config, VarlenAttention.Config)
    for _, _, parent, attribute in list(config.model_spec.model.traverse(masked)):
        if isinstance(attribute, int):
            parent[attribute] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attribute, ScaledDotProductAttention.Config())
    config.hf_assets_path = str(ASSETS / "tokenizer")
    config.dataloader.dataset_path = str(ASSETS / "c4_test")
    config.checkpoint.enable = False
    config.validator.enable = False
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.disable_cuda_graphs = True  # no CUDA graphs on CPU; torchtitan refuses PP with them on
    return config


def llama3_debugmodel() -> Trainer.Config:
    return traceable_on_cpu(llama3_registry.llama3_debugmodel())


def qwen3_moe_debug() -> Trainer.Config:
    return traceable_on_cpu(qwen3_registry.qwen3_moe_debug())


def qwen3_moe_debug_2layers() -> Trainer.Config:
    """qwen3_moe_debug with the first 2 of its 8 (identical) MoE layers: torchtitan's CLI cannot shorten the
    layer list, and each layer holds 64 experts of 3 x 768 x 256 weights, so a trace of the full model
    (weights, gradients and AdamW states per step) is about 10 GB, more than this machine's disk allows
    per benchmark row."""
    config = qwen3_moe_debug()
    config.model_spec.model.layers = config.model_spec.model.layers[:2]
    return config


def deepseek_v3_debugmodel() -> Trainer.Config:
    return traceable_on_cpu(deepseek_v3_registry.deepseek_v3_debugmodel())
