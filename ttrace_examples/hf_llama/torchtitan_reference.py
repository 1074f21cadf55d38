"""transformers' LlamaForCausalLM trained as torchtitan's Trainer trains llama3: the HF reference of a torchtitan candidate.

    ttrace record --out runs/hf -- python -m ttrace_examples.hf_llama.torchtitan_reference \\
        --module ttrace_examples.torchtitan --config llama3_debugmodel --training.steps 2 ...
    ttrace compare runs/hf runs/cand --map hf-llama--torchtitan-llama3

It takes the candidate's own torchtitan arguments (those after `-m ttrace_examples.torchtitan`), parses them
with torchtitan's ConfigManager, and, on one process:
- builds LlamaConfig from torchtitan's built llama3 model (sizes, norm eps, RoPE theta and llama3 frequency
  scaling; eager attention, so nothing of the attention is fused away);
- draws torchtitan's logical weights as ttrace's `attach(weights="reinit")` gives them to the candidate,
  from (seed, torchtitan name), constants (the norms' ones) kept, and converts them into HF's parameters
  through the map's [[parameters]] rules inverted; perturbed by HF name for `ttrace estimate`;
- reads torchtitan's batches (its dataloader built for data-parallel size 1: the stream a one-rank candidate
  reads, and ttrace's micro-batch rule deals it to data-parallel ranks), with its per-document positions;
- computes the loss with torchtitan's own ChunkedLossWrapper around HF's lm_head (each chunk's token-loss sum
  over the step's valid tokens), clips with torchtitan's clip_grad_norm_, and steps torchtitan's own
  optimizer and lr schedule built from the same config, on HF's parameters.
So every difference a comparison finds is the model code's. fp32 only (`--training.mixed_precision_param
float32` on the candidate). The ttrace lines are marked `# ttrace`.
"""

from __future__ import annotations

import json
import sys

import torch

import ttrace_core as ttrace
from ttrace_core.canonicalize.correspondence import facts_from_config, reference_state
from ttrace_core.integrations.shipped_maps import find_map
from ttrace_core.integrations.torch_native import manifest_from_model
from ttrace_core.integrations.torchtitan import use_cpu_without_accelerator
from ttrace_core.record.generator import initialize_weights
from ttrace_core.record.session import active_spec

MAP = "hf-llama--torchtitan-llama3"
IGNORE_INDEX = -100


def torchtitan_config(argv: list[str]):
    """torchtitan's Trainer.Config from its command line, with the model config updated as the Trainer does."""
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(argv)
    config.model_spec.model.update_from_config(config=config)
    return config


def torchtitan_model(config, seed: int) -> torch.nn.Module:
    """torchtitan's llama3 on the CPU with the logical weights a ttrace-recorded candidate gets (reinit)."""
    model = config.model_spec.model.build()
    model.init_weights(buffer_device=torch.device("cpu"))
    initialize_weights(model, seed=seed, reinit=True, perturbation=None, rename=lambda name: name)
    return model


def llama_config(titan: torch.nn.Module, dtype_name: str):
    """The LlamaConfig of the same architecture as torchtitan's built llama3 model."""
    from transformers import LlamaConfig

    layer = next(iter(titan.layers.children()))
    attention, rope = layer.attention, layer.attention.rope.config
    if rope.scaling not in ("llama", "none"):
        raise ValueError(f"torchtitan's RoPE scaling {rope.scaling!r}: the HF reference maps 'llama' and 'none' only")
    rope_parameters = {"rope_type": "default", "rope_theta": float(rope.theta)}
    if rope.scaling == "llama":
        rope_parameters = {"rope_type": "llama3", "rope_theta": float(rope.theta), "factor": rope.scaling_factor,
                           "low_freq_factor": rope.low_freq_factor, "high_freq_factor": rope.high_freq_factor,
                           "original_max_position_embeddings": rope.original_max_position_embeddings}
    llama = LlamaConfig(vocab_size=titan.tok_embeddings.weight.shape[0], hidden_size=titan.tok_embeddings.weight.shape[1],
                        intermediate_size=layer.feed_forward.w1.weight.shape[0], num_hidden_layers=len(titan.layers),
                        num_attention_heads=attention.n_heads, num_key_value_heads=attention.n_kv_heads,
                        head_dim=attention.head_dim, max_position_embeddings=rope.max_seq_len,
                        rms_norm_eps=layer.attention_norm.eps, rope_parameters=rope_parameters,
                        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, hidden_act="silu",
                        attention_dropout=0.0, dtype=dtype_name)
    llama._attn_implementation = "eager"
    return llama


def decoder_model(hf_config) -> torch.nn.Module:
    """LlamaForCausalLM whose forward returns the final norm's output, as torchtitan's Decoder does for its
    chunked loss (`_skip_lm_head`): the loss calls lm_head per chunk. Its parameters and modules keep HF's
    names; one call of the root per micro-batch is ttrace's micro-batch clock, as on the candidate."""
    from transformers import LlamaForCausalLM

    class LlamaHiddenStates(LlamaForCausalLM):
        def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
            return self.model(input_ids=input_ids, position_ids=positions).last_hidden_state

    return LlamaHiddenStates(hf_config)


def init_weights(model: torch.nn.Module, titan: torch.nn.Module, seed: int, facts: dict[str, int]) -> None:
    """torchtitan's logical weights converted into HF's parameters through the map; perturbed by HF name."""
    drawn = {name: param.detach() for name, param in titan.named_parameters()}
    reference_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    state = reference_state(find_map(MAP), drawn, reference_shapes, facts)
    perturbation = ttrace.weight_perturbation()  # ttrace
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(state[name] if perturbation is None else perturbation.apply(seed, name, state[name]))


def main(argv: list[str] | None = None) -> None:
    use_cpu_without_accelerator()
    from torchtitan.distributed.utils import clip_grad_norm_
    config = torchtitan_config(sys.argv[1:] if argv is None else argv)
    if config.training.mixed_precision_param != "float32":
        raise ValueError("the HF reference of torchtitan is fp32 only: pass --training.mixed_precision_param float32 "
                         f"(got {config.training.mixed_precision_param!r})")
    spec = active_spec()
    seed = spec.seed if spec is not None else 0
    titan = torchtitan_model(config, seed)
    hf_config = llama_config(titan, "float32")
    model = decoder_model(hf_config)
    init_weights(model, titan, seed, facts_from_config(find_map(MAP), hf_config.to_dict(), "the LlamaConfig"))
    del titan
    optimizers = config.optimizer.build(model_parts=[model])
    lr_schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=config.training.steps)
    loss_fn = config.loss.build()
    loss_fn.set_lm_head(model.lm_head)
    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    local_batch_size = config.training.local_batch_size
    global_batch_size = config.training.global_batch_size if config.training.global_batch_size > 0 else local_batch_size
    num_micro_batches = global_batch_size // local_batch_size
    dataloader = config.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=config.training.seq_len,
                                         local_batch_size=local_batch_size, snapshot_every_n_steps=None)
    manifest = manifest_from_model(model, "reference", 1)  # ttrace
    manifest.model["config"], manifest.seed = json.loads(hf_config.to_json_string()), seed  # ttrace
    session = ttrace.attach(model, optimizers, loss_scale=1 / num_micro_batches, weights="own", manifest=manifest)  # ttrace
    data_iterator = iter(dataloader)
    for step in range(config.training.steps):
        with session.step(step):  # ttrace
            optimizers.zero_grad()
            batches = [next(data_iterator) for _ in range(num_micro_batches)]
            global_valid_tokens = sum((labels != IGNORE_INDEX).sum() for _, labels in batches)
            total = 0.0
            for inputs, labels in batches:
                hidden = model(inputs["input"], positions=inputs.get("positions"))
                loss, _ = loss_fn(hidden, labels, global_valid_tokens)
                loss.backward()
                total += float(loss.detach())
            grad_norm = clip_grad_norm_(list(model.parameters()), config.training.max_norm, foreach=True)
            optimizers.step()
            lr_schedulers.step()
        print(f"step {step + 1}: loss {total:.5f} grad_norm {float(grad_norm):.4f}", flush=True)
    session.close()  # ttrace


if __name__ == "__main__":
    main()
