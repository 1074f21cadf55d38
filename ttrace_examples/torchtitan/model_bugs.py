"""Bugs in torchtitan's llama3 model code itself, for the HF reference of docs/porting.md: torchtitan's own
Trainer with one model-code bug, run as the launcher runs it.

    ttrace record --out runs/bug -- torchrun --standalone --nproc-per-node 2 -m ttrace_examples.torchtitan.model_bugs \\
        --bug rotary-half-split --module ttrace_examples.torchtitan --config llama3_debugmodel ...

Each patch computes the same wrong function on one rank and under tensor parallelism (it acts on one head's
dims or one token's features, which no TP layout splits), so the same-code one-rank reference, running the
same patch, passes it; only an independent implementation (HF's Llama through the map
hf-llama--torchtitan-llama3) sees it. Nothing in site-packages changes: torchtitan's classes are patched in
this process only, then torchtitan's own main() runs with the remaining arguments. The line that makes a
patch wrong carries a `# BUG:` comment. The megatron-core counterparts are ttrace_examples/megatron_gpt/model_bugs.py.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from ttrace_core.integrations.patching import patch_attribute

Undo = Callable[[], None]


def _rotate_half_split(x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    # BUG: dim i paired with dim i + head_dim/2 (HF's rotate_half layout); torchtitan's weights, converted
    # for its ComplexRoPE, pair adjacent dims (2i, 2i+1).
    pairs = torch.complex(x.float()[..., :half].contiguous(), x.float()[..., half:].contiguous())
    rotated = pairs * rope_cache
    return torch.cat([rotated.real, rotated.imag], dim=-1).type_as(x)


def apply_rotary_half_split() -> Undo:
    """ComplexRoPE rotates the half-split pairs of each head with torchtitan's own frequencies: a consistent
    rotary, but not the one torchtitan's (and Llama's checkpoint-converted) weights are laid out for."""
    from torchtitan.models.common.rope import ComplexRoPE

    def apply_rotary_emb(query: torch.Tensor, key: torch.Tensor, rope_cache: torch.Tensor):
        return _rotate_half_split(query, rope_cache), _rotate_half_split(key, rope_cache)

    return patch_attribute(ComplexRoPE, "apply_rotary_emb", staticmethod(apply_rotary_emb))


def apply_norm_eps_outside_sqrt() -> Undo:
    """torchtitan's RMSNorm (torch.nn.RMSNorm) computes x / (sqrt(mean(x^2)) + eps) * weight: every norm of the
    model, the final one too."""
    from torchtitan.models.common.nn_modules import RMSNorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        root_mean_square = x.pow(2).mean(-1, keepdim=True).sqrt()
        # BUG: epsilon outside the root; RMSNorm is x / sqrt(mean(x^2) + eps).
        return x / (root_mean_square + self.eps) * self.weight

    return patch_attribute(RMSNorm, "forward", forward)


MODEL_BUGS: dict[str, Callable[[], Undo]] = {
    "rotary-half-split": apply_rotary_half_split,
    "norm-eps-outside-sqrt": apply_norm_eps_outside_sqrt,
}
"""Bug name -> its patch."""

CULPRITS: dict[str, tuple[str, ...]] = {
    "rotary-half-split": ("layers.*.attention",),
    "norm-eps-outside-sqrt": ("layers.*.attention_norm", "layers.*.ffn_norm", "norm"),
}
"""Bug name -> fnmatch globs of the modules `ttrace localize` against HF may name first. Rotary is named at the attention:
the queries and keys after rotary have no HF counterpart, so the replay cannot feed the inner attention
(docs/porting.md, "Localization")."""


def bug_from_argv(argv: list[str]) -> tuple[str, list[str]]:
    """`--bug NAME` taken out of torchtitan's arguments."""
    if "--bug" not in argv or argv.index("--bug") + 1 >= len(argv):
        raise SystemExit(f"model_bugs: pass --bug NAME first, one of {', '.join(MODEL_BUGS)}")
    at = argv.index("--bug")
    name = argv[at + 1]
    if name not in MODEL_BUGS:
        raise SystemExit(f"model_bugs: unknown bug {name!r}; one of {', '.join(MODEL_BUGS)}")
    return name, argv[:at] + argv[at + 2:]


def main() -> None:
    from ttrace_examples.torchtitan import launcher

    name, sys.argv[1:] = bug_from_argv(sys.argv[1:])
    launcher.use_cpu_without_accelerator()
    MODEL_BUGS[name]()
    launcher.main()


if __name__ == "__main__":
    main()
