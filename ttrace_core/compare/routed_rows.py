"""Part of stage 3 (compare): a routed module's rows aligned by token when the two runs routed differently.

Input: the key of a MoE expert's tensor, and both runs' token positions of that expert's forward call
(format/schema.py TOKENS_SLOT, recorded by record/token_rows.py). Output: when the two runs sent that
expert different tokens, the row indices of the tokens both sent it, in each run's own order (both are
in token order, so the i-th common token is at row `reference_rows[i]` in the reference and
`candidate_rows[i]` in the candidate), and a note saying how many tokens only one run sent there.

Why: a router whose k-th and (k+1)-th scores are within round-off of each other sends a token to
another expert in the candidate than in the reference (bf16 expert compute makes that common). The
expert then holds other rows: one more or one less, a shape no layout explains, or as many as before
when a token left and another arrived (then row i is another token's in each run, and compared row by
row they read as a bug of order 1). Every token both runs routed alike must still agree, and the
routing difference itself shows where it matters, in the MoE layer's output (judged against the
perturbation estimate, whose re-runs flip routing the same way; `routed_apart` tells the estimate
which of its re-runs' rows are not the reference's tokens). A dispatcher that sends tokens to the
wrong expert changes that output beyond it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ttrace_core.format.reader import RunReader
from ttrace_core.format.schema import TensorKey


@dataclass(frozen=True, slots=True)
class TokenAlignment:
    reference_rows: torch.Tensor
    candidate_rows: torch.Tensor
    note: str


_ROUTED: weakref.WeakKeyDictionary[RunReader, tuple[dict[tuple, TensorKey], dict[TensorKey, torch.Tensor | None]]] = \
    weakref.WeakKeyDictionary()
"""Per reader: (step, micro-batch, call, fqn) of each routed call -> its positions' key; positions read so far
(every tensor of an expert asks for the same ones)."""


def _routed(reader: RunReader) -> tuple[dict[tuple, TensorKey], dict[TensorKey, torch.Tensor | None]]:
    if (found := _ROUTED.get(reader)) is None:
        found = _ROUTED[reader] = ({(k.step, k.micro_batch, k.call, k.fqn): k for k in reader.tokens}, {})
        # (a reader's tokens are fixed once it is open)
    return found


def _positions(reader: RunReader, tokens_key: TensorKey) -> torch.Tensor | None:
    read = _routed(reader)[1]
    if tokens_key not in read:
        metas = reader.tokens.get(tokens_key)
        read[tokens_key] = None if not metas else reader.read(metas[0]).to(torch.int64).flatten()
    return read[tokens_key]


def _tokens_key(key: TensorKey, reference: RunReader, candidate: RunReader) -> TensorKey | None:
    """The positions' key of the routed call `key` belongs to (its module or the nearest ancestor that both runs
    recorded positions for), or None."""
    if not reference.tokens or not candidate.tokens:  # (most runs: no routed module)
        return None
    ref_calls, cand_calls = _routed(reference)[0], _routed(candidate)[0]
    fqn = key.fqn
    while fqn:
        call = (key.step, key.micro_batch, key.call, fqn)
        if call in ref_calls and call in cand_calls:
            return ref_calls[call]
        fqn = fqn.rpartition(".")[0]
    return None


def routed_apart(key: TensorKey, reference: RunReader, other: RunReader) -> bool:
    """Whether `key` is a routed module's tensor (or inside one) to which the two runs sent different tokens."""
    tokens_key = _tokens_key(key, reference, other)
    if tokens_key is None:
        return False
    mine, theirs = _positions(reference, tokens_key), _positions(other, tokens_key)
    return mine is not None and theirs is not None and not torch.equal(mine, theirs)


def token_alignment(key: TensorKey, reference: RunReader, candidate: RunReader) -> TokenAlignment | None:
    """The common tokens' rows of `key` in both runs, when both recorded the token positions of the routed
    module it belongs to (the key's module or the nearest ancestor that has them), each run's rows are
    exactly its tokens, and the runs sent it different tokens; None otherwise (the same tokens: compared row
    by row; a shape difference then stays a structural failure)."""
    tokens_key = _tokens_key(key, reference, candidate)
    if tokens_key is None:
        return None
    reference_tokens, candidate_tokens = _positions(reference, tokens_key), _positions(candidate, tokens_key)
    if reference_tokens is None or candidate_tokens is None or torch.equal(reference_tokens, candidate_tokens):
        return None
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
