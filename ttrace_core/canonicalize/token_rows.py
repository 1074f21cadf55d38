"""Part of stage 2 (canonicalize): the rows of a routed module (a MoE expert), put in canonical order.

A routed module's rows are tokens permuted by expert and, under expert parallelism, gathered from the
ranks of an expert-parallel group. `TokenRows` says which token (and, for a module computing several
experts per call, which expert) each row holds; `pieces` cuts the rows into one tensor per source
micro-batch (and expert) in token order, which is the logical tensor both runs are recorded as
(record/token_rows.py explains why this happens while recording). No placement describes such a
gather; the ids make it an exact rearrangement.

A token id is `micro_batch * tokens_per_micro_batch + position`, with `position` the token's place in its
micro-batch's flattened leading two dims ([sequence, batch] in megatron, [batch, sequence] in
torchtitan; `token_ids`); -1 marks a padding row, which is dropped. Worked example: with 4 tokens per
micro-batch, rows holding ids [6, 3, 4, 1] of a call covering micro-batches (0, 1) give micro-batch 0
rows [3, 1] (tokens 1 and 3) and micro-batch 1 rows [2, 0] (tokens 4 and 6, positions 0 and 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ttrace_core.canonicalize.placements import local_runs
from ttrace_core.format.schema import Layout


@dataclass(frozen=True, slots=True)
class TokenRows:
    """Which token each row of one routed-module call holds."""

    ids: torch.Tensor
    """int64 [rows]: micro_batch * tokens_per_micro_batch + position, or -1 for a padding row."""
    tokens_per_micro_batch: int
    micro_batches: tuple[int, ...]
    """Every global micro-batch this call covers (its rows come from these, possibly none from some)."""
    experts: torch.Tensor | None = None
    """int64 [rows]: the global expert each row is for, when the module computes several experts per call."""
    experts_held: tuple[int, ...] = ()
    """With `experts`: every expert this call computes (possibly on no token)."""

    def __post_init__(self) -> None:
        if self.ids.dim() != 1 or self.ids.dtype != torch.int64:
            raise ValueError(f"token ids must be one int64 id per row, got {self.ids.dtype} {tuple(self.ids.shape)}")
        if self.tokens_per_micro_batch < 1:
            raise ValueError(f"tokens_per_micro_batch is {self.tokens_per_micro_batch}; it must be at least 1")
        if self.experts is not None and (self.experts.shape != self.ids.shape or not self.experts_held):
            raise ValueError(f"experts {tuple(self.experts.shape)} must give one expert per row of ids "
                             f"{tuple(self.ids.shape)}, and experts_held the experts of the call")

    @property
    def num_rows(self) -> int:
        return self.ids.numel()

    def pieces(self) -> list[tuple[int, int | None, torch.Tensor]]:
        """(global micro-batch, expert or None, row indices in token order) for every micro-batch this call
        covers (and every expert it holds, when it says which expert each row is for)."""
        valid = self.ids >= 0
        source = torch.where(valid, self.ids // self.tokens_per_micro_batch, torch.full_like(self.ids, -1))
        found = {int(m) for m in torch.unique(source[valid]).tolist()}
        if not found <= set(self.micro_batches):
            raise ValueError(f"rows hold tokens of micro-batches {sorted(found - set(self.micro_batches))}, "
                             f"outside the call's micro-batches {list(self.micro_batches)}")
        if self.experts is not None and not {int(e) for e in self.experts[valid].tolist()} <= set(self.experts_held):
            raise ValueError(f"rows are for experts outside the call's experts {list(self.experts_held)}")
        result = []
        for micro_batch in self.micro_batches:
            for expert in (None,) if self.experts is None else self.experts_held:
                chosen = source == micro_batch if expert is None else (source == micro_batch) & (self.experts == expert)
                rows = torch.nonzero(chosen).flatten()
                order = torch.argsort(self.ids[rows], stable=True)
                result.append((micro_batch, expert, rows[order]))
        return result


def expert_fqn(fqn: str, expert: int | None) -> str:
    """Where one expert of a module that computes several is recorded: "inner_experts" -> "inner_experts.3"."""
    return fqn if expert is None else f"{fqn}.{expert}"


def token_ids(micro_batch: int, local_shape: tuple[int, ...], layout: Layout | None) -> tuple[torch.Tensor, int]:
    """The ids of the tokens a rank holds in a [d0, d1, ...] activation whose first two dims are its tokens,
    flattened d0-major (`layout`: its recorded layout, None when the rank holds it whole), and the tokens
    per micro-batch. Under sequence parallelism the layout says which positions this rank's shard holds."""
    if layout is None:
        first, second = torch.arange(local_shape[0]), torch.arange(local_shape[1])
        num_first, num_second = local_shape[0], local_shape[1]
    else:
        runs = local_runs(layout)
        first, second = (torch.cat([torch.arange(start, start + length) for start, length in runs[dim]])
                         for dim in (0, 1))
        num_first, num_second = layout.global_shape[0], layout.global_shape[1]
    if (first.numel(), second.numel()) != tuple(local_shape[:2]):
        raise ValueError(f"the layout {layout} gives this rank {first.numel()} x {second.numel()} tokens but it "
                         f"holds {tuple(local_shape[:2])}")
    tokens_per_micro_batch = num_first * num_second
    return micro_batch * tokens_per_micro_batch + first[:, None] * num_second + second[None, :], tokens_per_micro_batch
