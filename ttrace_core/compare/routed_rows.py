"""Part of stage 3 (compare): a routed module's rows aligned by token when the two runs routed differently.

Input: the key of a MoE expert's tensor whose row counts differ between the runs, and both runs' token
positions of that expert's forward call (format/schema.py TOKENS_SLOT, recorded by record/token_rows.py).
Output: the row indices of the tokens both runs sent to that expert, in each run's own order (both are
in token order, so the i-th common token is at row `reference_rows[i]` in the reference and
`candidate_rows[i]` in the candidate), and a note saying how many tokens only one run sent there.

Why: a router whose k-th and (k+1)-th scores are within round-off of each other sends a token to
another expert in the candidate than in the reference (bf16 expert compute makes that common). Both
experts then hold one row more or less, a shape no layout explains; but every token both runs routed
alike must still agree, and the routing difference itself shows where it matters, in the MoE layer's
output (judged against the perturbation estimate, whose re-runs flip routing the same way). A
dispatcher that sends tokens to the wrong expert changes that output beyond it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ttrace_core.format.reader import RunReader
from ttrace_core.format.schema import TOKENS_SLOT, TensorKey


@dataclass(frozen=True, slots=True)
class TokenAlignment:
    reference_rows: torch.Tensor
    candidate_rows: torch.Tensor
    note: str


def _positions(reader: RunReader, key: TensorKey) -> torch.Tensor | None:
    metas = reader.tokens.get(key)
    return None if not metas else reader.read(metas[0]).to(torch.int64).flatten()


def token_alignment(key: TensorKey, reference: RunReader, candidate: RunReader) -> TokenAlignment | None:
    """The common tokens' rows of `key` in both runs, when both recorded the token positions of the routed
    module it belongs to (the key's module or the nearest ancestor that has them) and each run's rows are
    exactly its tokens; None otherwise (the shape difference stays a structural failure)."""
    parts = key.fqn.split(".")
    for end in range(len(parts), 0, -1):
        tokens_key = TensorKey(step=key.step, micro_batch=key.micro_batch, phase="forward",
                               fqn=".".join(parts[:end]), slot=TOKENS_SLOT, call=key.call)
        reference_tokens, candidate_tokens = _positions(reference, tokens_key), _positions(candidate, tokens_key)
        if reference_tokens is None or candidate_tokens is None:
            continue
        ref_shape = reference.index[key][0].layout.global_shape
        cand_shape = candidate.index[key][0].layout.global_shape
        if not ref_shape or ref_shape[1:] != cand_shape[1:] or \
                (ref_shape[0], cand_shape[0]) != (reference_tokens.numel(), candidate_tokens.numel()):
            return None
        in_candidate = torch.isin(reference_tokens, candidate_tokens)
        in_reference = torch.isin(candidate_tokens, reference_tokens)
        only_reference, only_candidate = int((~in_candidate).sum()), int((~in_reference).sum())
        note = (f"routed differently: {only_reference} of the reference's {reference_tokens.numel()} tokens went to "
                f"another expert in the candidate, and {only_candidate} of the candidate's {candidate_tokens.numel()} "
                f"came here from another; compared on the {int(in_candidate.sum())} tokens both sent here "
                "(the routing difference shows in the MoE layer's output)")
        return TokenAlignment(reference_rows=torch.nonzero(in_candidate).flatten(),
                              candidate_rows=torch.nonzero(in_reference).flatten(), note=note)
    return None
