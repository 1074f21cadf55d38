"""A minimal reproduction, without ttrace, of transformers 5.24 all-reducing q_norm / k_norm gradients
at every backward under gradient accumulation (docs/findings.md).

    torchrun --standalone --nproc-per-node 2 tests/thirdparty/hf_qk_norm_accumulation.py [--models DIR]

A tiny dense Qwen3 loaded with `from_pretrained(..., distributed_config=DistributedConfig(tp_size=2))`
(its plan puts `replicated_with_grad_allreduce` on `layers.*.self_attn.q_norm` / `k_norm`). The same
two micro-batches are backpropagated three ways from the same weights:

- accumulated: `l0.backward(); l1.backward()`, as any gradient-accumulation loop does;
- one pass: `(l0 + l1).backward()`, which gradient accumulation must equal;
- doubled first: `(2 l0 + l1).backward()`.

Autograd sums gradients linearly, so the accumulated gradient must equal the one pass. Every other
parameter does (relative difference ~1e-7); q_norm / k_norm equal the doubled first instead, because
the style's post-accumulate-grad hook all-reduces `param.grad`, which after the second backward holds
the first micro-batch's already reduced gradient too. Prints one line per norm and, on rank 0,
`BUG REPRODUCED` or `NOT REPRODUCED`; exits 0 either way.

`--patched` installs a candidate fix first: the style all-reduces each backward's own gradient in a
tensor hook on the parameter (before it is accumulated into `.grad`), so accumulation sums reduced
micro-batch gradients. With it the accumulated gradients equal the one pass (NOT REPRODUCED).
"""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

VOCAB, SEQ = 128, 32


def patch_style() -> None:
    """The candidate fix: reduce the gradient of this backward, not the accumulated `.grad`."""
    from transformers.distributed.tensor_parallel import ReplicatedWithGradAllReduce

    def install_forward(self, module, mesh):
        original_forward, hooked = module.forward, {}

        def reduced(grad):
            grad = grad.clone()
            dist.all_reduce(grad, group=mesh.get_group())
            return grad

        def tp_forward(*args, **kwargs):
            if torch.is_grad_enabled():
                for name, param in module.named_parameters(recurse=False):
                    if param.requires_grad and hooked.get(name) is not param:
                        param.register_hook(reduced)
                        hooked[name] = param
            return original_forward(*args, **kwargs)

        module.forward = tp_forward
        return module

    ReplicatedWithGradAllReduce.install_forward = install_forward


def tiny_qwen3(root: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    path = root / f"qwen3-rank{os.environ.get('RANK', '0')}"  # one copy per rank: nothing shared
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                             tie_word_embeddings=False)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def grads(model, weights: list[float]) -> dict[str, torch.Tensor]:
    """Each parameter's full gradient after backpropagating the micro-batches' losses, weighted, either
    one backward each (weights None) or summed into one backward."""
    model.zero_grad(set_to_none=True)
    losses = [model(input_ids=tokens, labels=tokens).loss for tokens in micro_batches()]
    if weights is None:
        for loss in losses:
            loss.backward()
    else:
        sum(w * loss for w, loss in zip(weights, losses)).backward()
    full = {}
    for name, param in model.named_parameters():
        grad = param.grad
        full[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return full


def micro_batches() -> list[torch.Tensor]:
    return [torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(m)) for m in range(2)]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="models")
    parser.add_argument("--patched", action="store_true", help="install the candidate fix first")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, DistributedConfig

    if args.patched:
        patch_style()
    path = tiny_qwen3(Path(args.models).resolve())
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2),
                                                 dtype=torch.float32)
    model.train()
    accumulated, one_pass, doubled = grads(model, None), grads(model, [1.0, 1.0]), grads(model, [2.0, 1.0])
    norms = [n for n in accumulated if n.endswith(("q_norm.weight", "k_norm.weight"))]
    others = [n for n in accumulated if n not in norms]
    reproduced = True
    if dist.get_rank() == 0:
        for name in norms:
            off, doubled_match = relative(accumulated[name], one_pass[name]), relative(accumulated[name], doubled[name])
            reproduced &= off > 1e-3 and doubled_match < 1e-5
            print(f"{name}: accumulated vs one pass {off:.3g}, vs 2*l0 + l1 {doubled_match:.3g}")
        worst = max(relative(accumulated[n], one_pass[n]) for n in others)
        print(f"every other parameter ({len(others)}): accumulated vs one pass at most {worst:.3g}")
        print("BUG REPRODUCED" if reproduced and worst < 1e-5 else "NOT REPRODUCED", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
