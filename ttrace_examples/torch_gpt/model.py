"""The GPT: token + position embedding, N blocks of LayerNorm / attention / MLP, final norm, LM head.

Layers live in a ModuleDict keyed by their global index, so a pipeline stage that keeps only some
of them still names them as the full model does ("layers.3.attn.wq"). A stage without the
embeddings receives hidden states; a stage without the head returns them.

Shape legend: B batch, T sequence, D model width, H local heads, K head dim, V vocab.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    vocab_size: int = 96
    """Token vocabulary; a multiple of the TP degree."""
    seq_len: int = 16
    """Tokens per sample; a multiple of the TP degree under sequence parallelism."""
    d_model: int = 64
    num_heads: int = 4
    """Attention heads; a multiple of the TP degree."""
    num_layers: int = 4
    """Transformer blocks; a multiple of the pipeline degree."""
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of num_heads {self.num_heads}")

    def to_dict(self) -> dict:
        return asdict(self)


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.head_dim = d // config.num_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d) for _ in range(4))
        self.context_parallel = None
        """Set under context parallelism: attends over the keys and values of the whole sequence."""

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        batch, seq = x_BTD.shape[0], x_BTD.shape[1]
        # Under TP wq/wk/wv return this rank's heads only: infer H from the local width.
        q_BHTK, k_BHTK, v_BHTK = (
            proj(x_BTD).view(batch, seq, -1, self.head_dim).transpose(1, 2) for proj in (self.wq, self.wk, self.wv)
        )
        if self.context_parallel is not None:
            y_BHTK = self.context_parallel(q_BHTK, k_BHTK, v_BHTK)
        else:
            y_BHTK = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTK, is_causal=True)
        return self.wo(y_BHTK.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.d_model, config.mlp_ratio * config.d_model)
        self.w2 = nn.Linear(config.mlp_ratio * config.d_model, config.d_model)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x_BTD)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.ln1(x_BTD))
        return x_BTD + self.mlp(self.ln2(x_BTD))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb: nn.Embedding | None = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb: nn.Embedding | None = nn.Embedding(config.seq_len, config.d_model)
        self.layers = nn.ModuleDict({str(i): Block(config) for i in range(config.num_layers)})
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(config.d_model)
        self.lm_head: nn.Linear | None = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.position_offset = 0
        """Position of this rank's first token: non-zero under context parallelism."""

    def forward(self, tokens_or_hidden: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            batch, seq = tokens_or_hidden.shape
            positions = torch.arange(self.position_offset, self.position_offset + seq, device=tokens_or_hidden.device)
            positions_BT = positions.expand(batch, seq)
            h_BTD = self.tok_emb(tokens_or_hidden) + self.pos_emb(positions_BT)
        else:
            h_BTD = tokens_or_hidden
        for layer in self.layers.values():
            h_BTD = layer(h_BTD)
        if self.ln_f is not None:
            h_BTD = self.ln_f(h_BTD)
        return self.lm_head(h_BTD) if self.lm_head is not None else h_BTD

    def keep_stage(self, stage: int, num_stages: int) -> None:
        """Drop what pipeline stage `stage` of `num_stages` does not run: contiguous layers per stage."""
        per_stage = self.config.num_layers // num_stages
        keep = {str(i) for i in range(stage * per_stage, (stage + 1) * per_stage)}
        for name in list(self.layers):
            if name not in keep:
                del self.layers[name]
        if stage != 0:
            self.tok_emb = self.pos_emb = None
        if stage != num_stages - 1:
            self.ln_f = self.lm_head = None


def loss_fn(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten())
