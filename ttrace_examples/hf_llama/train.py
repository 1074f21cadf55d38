"""One training run of transformers' LlamaForCausalLM on one process: what `ttrace example hf-llama` launches;
with `--moe`, of MixtralForCausalLM (Llama with top-k routed SwiGLU experts), the reference of
`ttrace example megatron-gpt --llama --moe` through the map hf-mixtral--megatron-gpt-moe.

The independent reference of a megatron-core candidate (`ttrace example megatron-gpt --llama`): the same
logical model built by another implementation, from a config (no hub access), on the same data with the
same optimizer, so that `ttrace compare HF_REF CAND --map hf-llama--megatron-gpt` judges megatron's model
code itself, not only its parallel layouts (docs/porting.md).

It takes the candidate's own run config (MegatronGPTRunConfig: model sizes, seed, micro-batches, lr), and:
- builds LlamaConfig from it (eager attention, so the attention probabilities are a module output);
- draws the candidate's logical weights exactly as the megatron example does, from (seed, megatron name),
  and converts them into HF's parameters through the map's [[parameters]] rules inverted: the weight
  conversion and the comparison are one statement of the correspondence;
- feeds megatron's micro-batches (tokens and next-token labels from (seed, micro-batch id)), averages the
  token losses of each micro-batch and scales by 1 / micro-batches, as megatron's schedule does;
- steps torch's AdamW with megatron's hyper-parameters (betas 0.9/0.999, eps, no weight decay, no clipping:
  clip_grad_norm_ with max_norm inf only measures the norm megatron records).
In bf16 it trains as megatron's bf16 does (Float16Module, DDP with grad_reduce_in_fp32, the mixed-precision
optimizer): bf16 parameters and compute, each gradient accumulated in fp32 over the micro-batches (`main_grad`,
what ttrace records), AdamW on fp32 main weights copied from the bf16 ones, and the bf16 parameters copied from
them after the step (`MainWeightsAdamW`).
The ttrace lines are marked `# ttrace`.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

import ttrace_core as ttrace
from ttrace_core.canonicalize.correspondence import candidate_shapes, facts_from_config, reference_state
from ttrace_core.integrations.shipped_maps import find_map
from ttrace_core.integrations.torch_native import manifest_from_model
from ttrace_examples.megatron_gpt.train import LOSSES_FILE, MegatronGPTRunConfig, _logical_weight, micro_batch

ENTRYPOINT = "ttrace_examples.hf_llama.train:run"
MAP = "hf-llama--megatron-gpt"
MOE_MAP = "hf-mixtral--megatron-gpt-moe"


def map_name(config: MegatronGPTRunConfig) -> str:
    return MOE_MAP if config.model.num_experts else MAP


def check_reference_config(config: MegatronGPTRunConfig) -> None:
    """ValueError unless the candidate's config describes a Llama (or, with experts, a Mixtral) that one HF
    process can train alike."""
    m = config.model
    problems = [text for bad, text in (
        (config.world_size != 1 or config.vpp != 1, "one process (tp, pp, dp, vpp 1): the reference runs alone"),
        (not (m.swiglu and m.normalization == "RMSNorm" and m.position_embedding == "rope" and not m.add_bias_linear),
         "Llama's choices (--llama: RMSNorm, RoPE, SwiGLU, no linear biases)"),
        (config.mtp_num_layers > 0 or config.per_token_loss, "a model without MTP or per-token loss"),
        # Mixtral renormalizes its top-k softmax; megatron at top-1 takes the softmax before the top-k
        # (moe_router_pre_softmax, train._moe_fields): a probability, not Mixtral's 1.
        (m.num_experts > 0 and not 2 <= m.moe_topk <= m.num_experts,
         "a top-k of 2 or more and at most the experts (--topk: at top-1 Mixtral weights an expert by 1, megatron by its probability)"),
        (config.moe_aux_loss is not None or config.moe_z_loss_coeff or config.moe_shared_expert_size,
         "Mixtral's experts: no aux or z loss, no shared expert"),
        (config.precision not in ("fp32", "bf16"), "precision fp32 or bf16"),
        (config.bug is not None, "no bug: bugs are injected into the megatron candidate"),
    ) if bad]
    if problems:
        raise ValueError(f"the HF Llama reference needs {'; '.join(problems)}")


def llama_config(config: MegatronGPTRunConfig):
    from transformers import LlamaConfig

    m = config.model
    llama = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size or 4 * m.hidden_size,
                        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                        num_key_value_heads=m.query_groups, max_position_embeddings=m.seq_len, rms_norm_eps=m.norm_epsilon,
                        rope_parameters={"rope_type": "default", "rope_theta": float(m.rotary_base)},
                        tie_word_embeddings=m.tie_embeddings, attention_bias=False, mlp_bias=False, hidden_act="silu",
                        attention_dropout=0.0)
    llama._attn_implementation = "eager"
    return llama


def mixtral_config(config: MegatronGPTRunConfig):
    """Llama's config as Mixtral's, with megatron's experts: each a SwiGLU of ffn_hidden_size (megatron's
    moe_ffn_hidden_size defaults to it), softmax over top-k routing, no router jitter; the aux loss is not
    computed (output_router_logits off), as megatron's is off."""
    from transformers import MixtralConfig

    m, llama = config.model, llama_config(config)
    mixtral = MixtralConfig(**{key: getattr(llama, key) for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "max_position_embeddings", "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "hidden_act", "attention_dropout")},
        num_local_experts=m.num_experts, num_experts_per_tok=m.moe_topk, router_jitter_noise=0.0,
        output_router_logits=False, sliding_window=None)
    mixtral._attn_implementation = "eager"
    mixtral._experts_implementation = "eager"  # the loop over experts, not a grouped GEMM kernel
    return mixtral


def init_weights(model: torch.nn.Module, config: MegatronGPTRunConfig, facts: dict[str, int]) -> None:
    """The candidate's logical weights, drawn by megatron's names, converted into this model's parameters
    through the map; perturbed by HF name for `ttrace estimate` (each HF parameter is its own tensor there)."""
    loaded = find_map(map_name(config))
    reference_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    drawn = {name: _logical_weight(config.seed, name, shape)
             for name, shape in candidate_shapes(loaded, reference_shapes, facts).items()}
    state = reference_state(loaded, drawn, reference_shapes, facts)
    perturbation = ttrace.weight_perturbation()  # ttrace
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = state[name] if perturbation is None else perturbation.apply(config.seed, name, state[name])
            param.copy_(value)


class MainWeightsAdamW(torch.optim.Optimizer):
    """AdamW over fp32 main weights of low-precision parameters, megatron's mixed-precision optimizer: the
    gradients come from each parameter's fp32 `main_grad`, the step updates the main weights, and the
    parameters are rounded from them. Its param_groups are the model's own parameters, so torch's step hooks
    (ttrace's) see the model's values before and after the step."""

    def __init__(self, params, **adamw) -> None:
        params = list(params)
        super().__init__(params, dict(adamw))  # the hyper-parameters in param_groups, where the lr is read
        self.main = [param.detach().float().clone().requires_grad_(True) for param in params]
        self.inner = torch.optim.AdamW(self.main, **adamw)
        for param in params:
            param.main_grad = torch.zeros_like(param, dtype=torch.float32)
            param.register_post_accumulate_grad_hook(_accumulate_in_fp32)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                param.main_grad.zero_()
                param.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        params = [param for group in self.param_groups for param in group["params"]]
        for main, param in zip(self.main, params):
            main.grad = param.main_grad
        self.inner.step()
        for main, param in zip(self.main, params):
            param.copy_(main)
        return None


def _accumulate_in_fp32(param: torch.Tensor) -> None:
    """megatron's DDP hook with grad_reduce_in_fp32: the micro-batch's gradient added to the fp32 main_grad."""
    param.main_grad.add_(param.grad.float())
    param.grad = None


def run(config_dict: dict) -> None:
    from transformers import LlamaForCausalLM, MixtralForCausalLM

    config = MegatronGPTRunConfig.from_dict(config_dict)
    check_reference_config(config)
    moe = config.model.num_experts > 0
    hf_config = mixtral_config(config) if moe else llama_config(config)
    model = (MixtralForCausalLM if moe else LlamaForCausalLM)(hf_config)
    init_weights(model, config, facts_from_config(find_map(map_name(config)), hf_config.to_dict(),
                                                  f"the {type(hf_config).__name__}"))
    adamw = dict(lr=config.lr, betas=(0.9, 0.999), eps=config.adam_eps, weight_decay=0.0)
    if config.precision == "bf16":
        model = model.to(torch.bfloat16)
        optimizer = MainWeightsAdamW(model.parameters(), **adamw)
        tracer_config = ttrace.TracerConfig(grad_attr="main_grad")  # ttrace: the fp32 gradient megatron records
        gradients = optimizer.main
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **adamw)
        tracer_config, gradients = None, list(model.parameters())
    manifest = manifest_from_model(model, "reference", 1)  # ttrace
    manifest.model["config"], manifest.seed = json.loads(hf_config.to_json_string()), config.seed  # ttrace
    num_micro_batches = config.num_micro_batches
    session = ttrace.attach(model, optimizer, loss_scale=1 / num_micro_batches, weights="own", manifest=manifest,  # ttrace
                            config=tracer_config)  # ttrace
    losses = []
    for step in range(config.steps):
        recorded = config.record_steps is None or step < config.record_steps
        with session.step(step) if recorded else nullcontext():  # ttrace
            optimizer.zero_grad()
            total = 0.0
            for global_id in range(num_micro_batches):
                batch = micro_batch(config, global_id)
                logits = model(input_ids=batch["tokens"]).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())
                (loss / num_micro_batches).backward()
                total += float(loss.detach())
            if config.precision == "bf16":  # the norm of the fp32 gradients, as megatron's optimizer takes it
                for main, param in zip(optimizer.main, model.parameters()):
                    main.grad = param.main_grad
            torch.nn.utils.clip_grad_norm_(gradients, max_norm=float("inf"))
            optimizer.step()
        losses.append(total / num_micro_batches)
    session.close()  # ttrace
    if session.run_dir is not None:
        Path(session.run_dir, LOSSES_FILE).write_text(json.dumps({"losses": losses}))
