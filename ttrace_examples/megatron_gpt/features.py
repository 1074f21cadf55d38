"""megatron-core features of the megatron-gpt example beyond its layouts: MoE load-balancing losses,
shared experts, multi-token prediction and per-token loss normalization.

The feature matrix (benchmarks/feature_matrix.py, docs/findings.md) turns them on in the reference
and in every candidate alike, so each candidate is still the same logical training step as its
one-rank reference. train.py reads them from `MegatronGPTRunConfig`'s feature block:

- `moe_aux_loss`: megatron's `moe_router_load_balancing_type` ("aux_loss", "seq_aux_loss",
  "global_aux_loss"), weighted by `moe_aux_loss_coeff`; None leaves the aux loss off (coeff 0).
- `moe_z_loss_coeff`: the router's z-loss (ST-MoE), 0 for none.
- `moe_shared_expert_size`: a shared expert's intermediate size beside the routed ones, 0 for none.
- `mtp_num_layers`: multi-token prediction layers after the decoder (their loss is weighted by
  megatron's default `mtp_loss_scaling_factor`), 0 for none.
- `per_token_loss`: megatron's `calculate_per_token_loss`: each micro-batch hands the schedule its
  summed token loss and token count, and finalize_model_grads divides the gradients by the step's
  global token count instead of averaging over micro-batches and DP ranks.
- `moe_global_aux_loss_dp_scaled`: a control for docs/findings.md, not a megatron option: the
  global_aux_loss and its coefficient multiplied by the DP size before they are attached, as
  NVIDIA/Megatron-LM#3769 proposes for #3672 (the loss is averaged over the tokens of every DP rank
  but only this rank's probabilities carry its gradient, and DDP averages over DP once more, so the
  gradient is 1/dp of the coefficient's). A no-op at dp 1: the reference is unchanged.
"""

from __future__ import annotations

import torch

AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")


def check_features(config) -> None:
    """ValueError for a feature combination the example cannot run."""
    if config.moe_aux_loss is not None and config.moe_aux_loss not in AUX_LOSS_TYPES:
        raise ValueError(f"moe_aux_loss {config.moe_aux_loss!r}: choose from {', '.join(AUX_LOSS_TYPES)}")
    moe_only = {"moe_aux_loss": config.moe_aux_loss is not None, "moe_z_loss_coeff": config.moe_z_loss_coeff > 0,
                "moe_shared_expert_size": config.moe_shared_expert_size > 0}
    if config.moe_global_aux_loss_dp_scaled and config.moe_aux_loss != "global_aux_loss":
        raise ValueError("moe_global_aux_loss_dp_scaled needs moe_aux_loss=global_aux_loss")
    for name, used in moe_only.items():
        if used and not config.model.num_experts:
            raise ValueError(f"{name} needs an MoE model (model.num_experts > 0)")
    if config.mtp_num_layers < 0 or config.moe_shared_expert_size < 0 or config.moe_z_loss_coeff < 0:
        raise ValueError("mtp_num_layers, moe_shared_expert_size and moe_z_loss_coeff must be >= 0")


def feature_transformer_fields(config) -> dict:
    """The TransformerConfig fields of the features that are on."""
    fields: dict = {}
    if config.moe_aux_loss is not None:
        fields.update(moe_router_load_balancing_type=config.moe_aux_loss, moe_aux_loss_coeff=config.moe_aux_loss_coeff)
    if config.moe_z_loss_coeff > 0:
        fields.update(moe_z_loss_coeff=config.moe_z_loss_coeff)
    if config.moe_shared_expert_size > 0:
        fields.update(moe_shared_expert_intermediate_size=config.moe_shared_expert_size)
    if config.mtp_num_layers > 0:
        fields.update(mtp_num_layers=config.mtp_num_layers)
    if config.per_token_loss:
        fields.update(calculate_per_token_loss=True)
    return fields


def gpt_model_kwargs(config, tconfig, spec, vp_stage: int | None = None) -> dict:
    """GPTModel's keyword arguments for the features that need one (the MTP block's spec, None off the
    pipeline stage that holds the MTP layers)."""
    if config.mtp_num_layers <= 0:
        return {}
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return {"mtp_block_spec": get_gpt_mtp_block_spec(tconfig, spec, use_transformer_engine=False, vp_stage=vp_stage)}


def per_token_loss_func(output: torch.Tensor):
    """Megatron's three-value loss: the micro-batch's summed token loss, its token count, what to log."""
    total = output.float().sum()
    num_tokens = torch.tensor(output.numel(), dtype=torch.int)
    return total, num_tokens, {"loss": (total / output.numel()).detach()}


def apply_upstream_patches(config) -> None:
    """Patches megatron in this process for the features that ask for one (before the model is built)."""
    if not config.moe_global_aux_loss_dp_scaled:
        return
    from megatron.core.transformer.moe.router import TopKRouter

    attach = TopKRouter.attach_and_log_load_balancing_loss

    def attach_dp_scaled(self, activation, aux_loss_coeff, aux_loss, aux_loss_name, reduce_group, *args, **kwargs):
        if aux_loss_name == "global_load_balancing_loss":
            dp_size = self.tp_dp_cp_group.size() // self.tp_cp_group.size()
            aux_loss, aux_loss_coeff = aux_loss * dp_size, aux_loss_coeff * dp_size
        return attach(self, activation, aux_loss_coeff, aux_loss, aux_loss_name, reduce_group, *args, **kwargs)

    TopKRouter.attach_and_log_load_balancing_loss = attach_dp_scaled
