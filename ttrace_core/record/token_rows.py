"""Part of stage 1 (record): the activations of routed experts, recorded by the tokens they hold.

Input: for each call of a routed module (a MoE expert), the token behind every row of its inputs,
outputs and their gradients (`canonicalize.token_rows.TokenRows`), from the adapter that watched the
token dispatcher permute them (integrations/megatron_moe.py, integrations/torchtitan.py). Output: the
Tracer records each such tensor cut and re-keyed so that it is "the tokens of global micro-batch m
that expert e received, in token order", whatever the layout.

Why at record time. An expert's input rows are tokens permuted by expert, and under expert
parallelism gathered from the data-parallel ranks of its expert-parallel group: expert 3 on EP rank 1
of a (dp 2, ep 2) run receives, in one call, the tokens of global micro-batches 0 and 1 that chose
it, ordered by source rank. The reference's expert 3 sees those of micro-batch 0 in one call and
those of micro-batch 1 in the next, in token order. Cut and ordered by the token ids, both runs are
recorded alike, so the logical tensor of (micro-batch m, expert e) is the same rows in the same order
on both sides, and canonicalize, compare and localize need nothing new. A micro-batch that sent an
expert no token is recorded as an empty tensor, as the reference's call on it is.

A module that computes several experts in one call (torchtitan's grouped experts) is recorded per
expert, as "<module>.<expert>" (expert 3 of `inner_experts` is `inner_experts.3`), in every run alike,
so each expert is a row of its own however the experts are dealt out over expert-parallel ranks.

Only tensors whose dim 0 has one entry per row are rearranged (inputs, outputs, their gradients). An
integer tensor of another shape in such a call is routing bookkeeping (torchtitan hands its grouped
experts the tokens per local expert, summed over the micro-batches of the call) and is not recorded:
each piece's row count says the same per micro-batch and expert. A floating one (a bias) is recorded
as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ttrace_core.canonicalize.token_rows import TokenRows


@dataclass(slots=True)
class RoutedTokens:
    """The token rows of the routed-module calls of one step, and which modules they hold for.

    A routed root (one expert) and every module inside it share the rows of the root's call: the
    expert's linear layers see the same tokens in the same order. Entries are keyed by the root's
    recorded name and the (global micro-batch, call) its forward was recorded under, and kept for
    the step, since the backward of that call needs them again."""

    roots: frozenset[str] = frozenset()
    calls: dict[tuple[str, int, int], TokenRows] = field(default_factory=dict)

    def root_of(self, fqn: str) -> str | None:
        """The routed root that `fqn` is or lies inside, if any."""
        if not self.roots:
            return None
        parts = fqn.split(".")
        for end in range(len(parts), 0, -1):
            candidate = ".".join(parts[:end])
            if candidate in self.roots:
                return candidate
        return None

    def rows_for(self, fqn: str, micro_batch: int, call: int) -> TokenRows | None:
        root = self.root_of(fqn)
        return None if root is None else self.calls.get((root, micro_batch, call))

    def expect(self, root: str, micro_batch: int, call: int, rows: TokenRows) -> None:
        if root not in self.roots:
            raise ValueError(f"{root} is not a routed module of this tracer (routed: {sorted(self.roots)[:4]}...)")
        self.calls[(root, micro_batch, call)] = rows
