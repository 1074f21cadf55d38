"""megatron-core cases of the real-bug corpus (corpus.py), run through the megatron-core example.

Each case is a `Recipe` applied by megatron_launch.py in every rank before the example builds its
model: `setup` in both runs (the option that reaches the bug, e.g. a model argument or a loss), and
`revert` in the candidate only (the upstream fix taken out, as the minimal pre-fix lines adapted to
megatron-core 0.16.1). A bug that 0.16.1 still ships has no `revert`: the candidate's layout alone
triggers it. The reference is the same command on one rank.

Tried and left out: Megatron-LM #5916 (the gradient norm undercounting experts under EP x TP) does not
occur in 0.16.1 on CPU: its SequentialMLP experts carry `tensor_model_parallel`, so the duplicate filter
keeps them; the reported path needs the grouped-GEMM experts (TransformerEngine / grouped_gemm, GPU
only). Measured: TP 2 + SP x EP 2 with clipping, the recorded gradient norm equals the reference's.
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.real_bugs.corpus import RealBug
from tests.real_bugs.runner import python_command, record_command

Patch = Callable[[], None]
SMALL = {"num_layers": 2, "hidden_size": 64, "seq_len": 16}
"""The model every case trains: 2 layers are enough to name the layer a bug is in."""


@dataclass(frozen=True, kw_only=True)
class Recipe:
    candidate: dict
    """The candidate's MegatronGPTRunConfig fields (the reference is the same with every degree 1)."""
    setup: Patch | None = None
    """Applied in both runs: the option that reaches the bug."""
    revert: Patch | None = None
    """Applied in the candidate only: the fix taken out, or an option the one-rank reference cannot run
    (megatron's gather of TP-sharded logits fails its autograd view check at TP 1)."""


def _megatron(module: str) -> Any:
    return importlib.import_module(f"megatron.core.{module}")


def _reference_of(candidate: dict) -> dict:
    parallel = {"tp": 1, "sp": False, "pp": 1, "vpp": 1, "dp": 1, "ep": 1, "dist_opt": False}
    return {**candidate, **parallel}


def record_megatron(case: str, work: Path, precision: str) -> tuple[Path, Path]:
    recipe = RECIPES[case]
    runs = []
    for role, config in (("reference", _reference_of(recipe.candidate)), ("candidate", recipe.candidate)):
        config = {**config, "precision": precision}
        out = work / role
        record_command(out, python_command("-m", "tests.real_bugs.megatron_launch", case, role,
                                           "--config", json.dumps(config, sort_keys=True), "--timeout", "300"))
        runs.append(out)
    return runs[0], runs[1]


# ---- #599: MoE router weights not all-reduced over TP under sequence parallelism --------------


def revert_pr_619() -> None:
    """Before https://github.com/NVIDIA/Megatron-LM/pull/619 the MoE router's weight carried no
    `sequence_parallel` attribute, so finalize_model_grads left its per-sequence-shard grads unsummed
    over TP (0.16.1 sets it in Router.reset_parameters, router.py)."""
    router = _megatron("transformer.moe.router").Router
    fixed = router.reset_parameters

    @functools.wraps(fixed)
    def reset_parameters(self) -> None:
        fixed(self)
        for param in (self.weight, getattr(self, "bias", None)):
            if param is not None and hasattr(param, "sequence_parallel"):
                del param.sequence_parallel  # pre-fix: the attribute was never set

    router.reset_parameters = reset_parameters


def fix_599_with_a_grad_hook() -> None:
    """Control: the pre-fix router, repaired the other way: all-reduce the routers' grads over TP
    by hand after finalize_model_grads. Numerically the upstream fix, written differently."""
    revert_pr_619()
    finalize = _megatron("distributed.finalize_model_grads")
    parallel_state = _megatron("parallel_state")
    fixed = finalize.finalize_model_grads

    @functools.wraps(fixed)
    def finalize_model_grads(model, *args, **kwargs):
        result = fixed(model, *args, **kwargs)
        group = parallel_state.get_tensor_model_parallel_group()
        for chunk in model:
            for name, param in chunk.named_parameters():
                if ".mlp.router." in name and group.size() > 1:
                    torch.distributed.all_reduce(param.main_grad, group=group)
        return result

    finalize.finalize_model_grads = finalize_model_grads
    # The example binds finalize_model_grads into the TransformerConfig from this module's namespace.
    importlib.import_module("megatron.core.distributed").finalize_model_grads = finalize_model_grads


# ---- #7452 item 2: gathered logits fed to the vocab-parallel cross entropy ----------------------


def gather_output_logits() -> None:
    """GPTModel(parallel_output=False): the output layer all-gathers the logits over TP, and
    compute_language_model_loss still hands them to vocab_parallel_cross_entropy as a vocab shard
    (megatron-core 0.16.1, models/gpt/gpt_model.py and language_module.py)."""
    gpt = _megatron("models.gpt.gpt_model").GPTModel
    original = gpt.__init__

    @functools.wraps(original)
    def init(self, *args, **kwargs) -> None:
        original(self, *args, **{**kwargs, "parallel_output": False})

    gpt.__init__ = init


# ---- #737 / #7464: label smoothing in the vocab-parallel cross entropy --------------------------


def label_smoothed_loss() -> None:
    """The loss through tensor_parallel.vocab_parallel_cross_entropy(..., label_smoothing=0.1), as
    NeMo-style recipes call it: its smoothing term uses the rank's vocab shard as if it were the vocab."""
    from ttrace_examples.megatron_gpt import train

    tensor_parallel = _megatron("tensor_parallel")

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        logits = model(batch["tokens"], batch["positions"], None)  # [b, s, vocab / tp]
        per_token_loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), batch["labels"], 0.1)

        def loss_func(output: torch.Tensor):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}

        return per_token_loss, loss_func

    train.forward_step = forward_step


# ---- #1450 / #750: the interleaved schedule's batched p2p at pipeline size 2 ---------------------------


def megatron_default_p2p() -> None:
    """megatron-core's own p2p defaults (batch_p2p_comm=True, overlap_p2p_comm=False) under the interleaved
    schedule, instead of the settings Megatron-LM's training and the example give VPP: at pipeline size 2
    the previous and the next stage are the same rank, and one batch_isend_irecv of both directions pairs
    activations and gradients crosswise (p2p_communication._batched_p2p_ops), with no error."""
    from ttrace_examples.megatron_gpt import train

    train._interleaved_p2p_fields = lambda config: {}


MOE = {"model": {**SMALL, "num_experts": 2}}
RECIPES: dict[str, Recipe] = {
    "mcore-moe-router-sp-replica": Recipe(candidate={"tp": 2, "sp": True, **MOE}, revert=revert_pr_619),
    "mcore-gathered-logits-ce": Recipe(candidate={"tp": 2, "model": SMALL}, revert=gather_output_logits),
    "mcore-label-smoothing-tp": Recipe(candidate={"tp": 2, "model": SMALL}, setup=label_smoothed_loss),
    "mcore-vpp-pp2-batched-p2p": Recipe(candidate={"pp": 2, "vpp": 2, "num_micro_batches": 4,
                                               "model": {**SMALL, "num_layers": 4}}, revert=megatron_default_p2p),
    "mcore-moe-per-token-router-loss-tp": Recipe(candidate={
        "tp": 2, "sp": True, "moe_aux_loss": "aux_loss", "moe_z_loss_coeff": 0.001, "per_token_loss": True,
        "model": {**SMALL, "num_experts": 4}}),
    "mcore-control-router-fix-by-hook": Recipe(candidate={"tp": 2, "sp": True, **MOE}, revert=fix_599_with_a_grad_hook),
}


def _case(name: str, **fields) -> RealBug:
    return RealBug(name=name, framework="megatron-core", record=functools.partial(record_megatron, name), **fields)


CASES: tuple[RealBug, ...] = (
    _case("mcore-moe-router-sp-replica",
          source="https://github.com/NVIDIA/Megatron-LM/issues/599",
          fix="https://github.com/NVIDIA/Megatron-LM/pull/619",
          reproduced_by="fix reverted", moe=True,
          summary="TP 2 + SP with MoE: the router weight lacks its sequence_parallel tag, so its grads (partial sums "
                  "over each rank's sequence shard) are never all-reduced over TP and the replicas drift apart.",
          touched="gradient reduction of decoder.layers.*.mlp.router.weight (TP all-reduce of sequence-parallel grads)",
          expected_culprits=("*mlp.router*",)),
    _case("mcore-gathered-logits-ce",
          source="https://github.com/NVIDIA/Megatron-LM/issues/7452",
          fix=None, reproduced_by="as shipped", moe=False,
          summary="TP 2 with GPTModel(parallel_output=False) and labels: the gathered (replicated) logits go to the "
                  "vocab-parallel cross entropy as if each rank held a vocab shard: loss + log(TP), wrong gradients.",
          touched="loss (compute_language_model_loss / vocab_parallel_cross_entropy on gathered logits)",
          expected_culprits=("the loss function", "(loss)*")),
    _case("mcore-label-smoothing-tp",
          source="https://github.com/NVIDIA/Megatron-LM/issues/737",
          fix=None, reproduced_by="as shipped", moe=False,
          summary="TP 2, vocab_parallel_cross_entropy with label_smoothing=0.1: the smoothing term uses the local vocab "
                  "size and the local mean log-probability, so loss and logit gradients differ from one rank's.",
          touched="loss (tensor_parallel/cross_entropy.py label smoothing)",
          expected_culprits=("the loss function", "(loss)*")),
    _case("mcore-vpp-pp2-batched-p2p",
          source="https://github.com/NVIDIA/Megatron-LM/issues/1450",
          fix=None, reproduced_by="as shipped", moe=False,
          summary="PP 2 x VPP 2 (interleaved 1F1B) with megatron-core's default batched p2p: the previous and next "
                  "stage are one rank, and one batch_isend_irecv pairs activations and gradients crosswise, so "
                  "micro-batch 2 on runs on another micro-batch's activations (also Megatron-LM #750; fix PR #1485 "
                  "open).",
          touched="pipeline p2p between decoder.layers.0 and decoder.layers.1 (p2p_communication._batched_p2p_ops)",
          expected_culprits=("between decoder.layers.0*decoder.layers.1*", "decoder.layers.1")),
    _case("mcore-moe-per-token-router-loss-tp",
          source="https://github.com/NVIDIA/Megatron-LM/pull/5047",
          fix="https://github.com/NVIDIA/Megatron-LM/pull/5047", reproduced_by="as shipped", moe=True,
          summary="MoE aux loss and z-loss with calculate_per_token_loss under TP 2 + SP: the router losses are scaled by "
                  "this rank's token count (1/tp of the sequence) before MoEAuxLossAutoScaler, and finalize_model_grads "
                  "divides by the global count, so the router-loss gradients depend on the TP size (0.16.1 predates "
                  "the fix; also Megatron-LM #1652 for CP).",
          touched="router losses (transformer/moe/router.py attach_and_log_load_balancing_loss, apply_z_loss)",
          expected_culprits=("*mlp.router*",)),
    _case("mcore-control-router-fix-by-hook",
          source="https://github.com/NVIDIA/Megatron-LM/pull/619",
          fix=None, reproduced_by="control", moe=True, control=True,
          summary="Control: #599's pre-fix router repaired by an explicit TP all-reduce of the router grads after "
                  "finalize_model_grads instead of the sequence_parallel tag; numerically the upstream fix.",
          touched="none (equivalent to the fix)", expected_culprits=()),
)
