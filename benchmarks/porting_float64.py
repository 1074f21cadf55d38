"""Are HF's Llama and torchtitan's llama3 the same function? One micro-batch through both, from the same weights
(ttrace_examples/hf_llama/torchtitan_reference.py's conversion through the map), in fp32 and in float64.

In float64 round-off is about 1e-16, so a real difference between the implementations (a rotary layout, a
norm, a scale) stays as large as in fp32 while round-off vanishes. Three places compute in fp32 whatever the
model's dtype and are lifted to float64 here, each a precision choice, not a formula: HF's eager attention
takes its softmax in float32, HF's LlamaRMSNorm upcasts to float32, and both sides build the rotary angles in
float32 (torchtitan's ComplexRoPE also rotates in complex64). Run by benchmarks/porting.py's torchtitan suite:

    python benchmarks/porting_float64.py --json out.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

ARGS = ["--module", "ttrace_examples.torchtitan", "--config", "llama3_debugmodel", "--training.seq_len", "64",
        "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32"]


def _lift_fp32_choices(titan: torch.nn.Module, hf: torch.nn.Module) -> None:
    """The three fp32 computations of the module docstring, in float64 (this process only)."""
    import transformers.models.llama.modeling_llama as modeling_llama
    from torchtitan.models.common.rope import ComplexRoPE

    for layer in titan.layers.values():
        rope = layer.attention.rope
        freqs = torch.angle(rope._precompute_cache()[1]).double()  # torchtitan's own frequencies, llama3-scaled
        positions = torch.arange(rope.cache.shape[0], dtype=torch.float64)
        rope.cache = torch.polar(torch.ones(len(positions), len(freqs), dtype=torch.float64), torch.outer(positions, freqs))

    def rotate(query, key, rope_cache):
        pairs = [torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous()) for x in (query, key)]
        return tuple(torch.view_as_real(p * rope_cache).flatten(3) for p in pairs)

    ComplexRoPE.apply_rotary_emb = staticmethod(rotate)
    rotary = hf.model.rotary_emb

    def cos_sin(x, position_ids):
        angles = position_ids[..., None].double() * rotary.inv_freq.double()
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos() * rotary.attention_scaling, angles.sin() * rotary.attention_scaling

    rotary.forward = cos_sin
    softmax = F.softmax
    modeling_llama.nn.functional.softmax = lambda x, dim=None, dtype=None: softmax(x, dim=dim)
    modeling_llama.LlamaRMSNorm.forward = lambda self, h: self.weight * (
        h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _forward_backward(model: torch.nn.Module, inputs: dict, labels: torch.Tensor, torchtitan: bool) -> dict:
    model.zero_grad()
    positions = inputs.get("positions")
    hidden = model(inputs["input"], positions) if torchtitan else model(inputs["input"], positions=positions)
    F.cross_entropy(model.lm_head(hidden).flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
    return {"hidden": hidden.detach().double(), **{name: p.grad.double() for name, p in model.named_parameters()}}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def measure() -> dict:
    from ttrace_core.canonicalize.correspondence import facts_from_config
    from ttrace_core.integrations.shipped_maps import find_map
    from ttrace_examples.hf_llama import torchtitan_reference as reference

    reference.use_cpu_without_accelerator()
    config = reference.torchtitan_config(ARGS)
    titan = reference.torchtitan_model(config, seed=0)
    titan._skip_lm_head = True  # the final norm's output, as the HF side returns
    hf_config = reference.llama_config(titan, "float32")
    hf = reference.decoder_model(hf_config)
    correspondence = find_map(reference.MAP)
    reference.init_weights(hf, titan, 0, facts_from_config(correspondence, hf_config.to_dict(), "the LlamaConfig"))
    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    inputs, labels = next(iter(config.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=64,
                                                       local_batch_size=2, snapshot_every_n_steps=None)))
    # gradients compared by the map's parameter rules: HF's converted into torchtitan's layout
    from ttrace_core.canonicalize.correspondence import candidate_state

    results = {}
    for dtype in (torch.float32, torch.float64):
        if dtype == torch.float64:
            titan.to(dtype)
            hf.to(dtype)
            _lift_fp32_choices(titan, hf)
        got = _forward_backward(titan, inputs, labels, torchtitan=True)
        expected = _forward_backward(hf, inputs, labels, torchtitan=False)
        shapes = {name: tuple(p.shape) for name, p in titan.named_parameters()}
        facts = facts_from_config(correspondence, hf_config.to_dict(), "the LlamaConfig")
        mapped = candidate_state(correspondence, {n: t for n, t in expected.items() if n != "hidden"}, facts)
        gradients = {name: _relative(got[name], mapped[name]) for name in shapes}
        worst = max(gradients, key=gradients.get)
        results[str(dtype).removeprefix("torch.")] = {
            "hidden_relative": _relative(got["hidden"], expected["hidden"]),
            "max_gradient_relative": gradients[worst], "max_gradient": worst}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="where the measurement goes")
    args = parser.parse_args()
    results = measure()
    with open(args.json, "w") as out:
        json.dump(results, out, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
