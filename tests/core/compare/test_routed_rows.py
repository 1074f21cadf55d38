"""compare/routed_rows.py: an expert's rows aligned by token when the two runs routed different tokens to it.
The rows of the tokens both runs sent there, in each run's own order, and one note saying how many only
one run sent; None whenever the rows cannot be aligned by token, so the shape difference stays a
structural failure. Runs written with the real writer, the token positions as record/token_rows.py
records them (forward, slot TOKENS_SLOT, of the routed module's call)."""

from __future__ import annotations

import pytest
import torch

from ttrace_core.compare.routed_rows import token_alignment
from ttrace_core.format.reader import RunReader
from ttrace_core.format.schema import TOKENS_SLOT, Layout, RunManifest, TensorKey, TensorMeta
from ttrace_core.format.writer import RunWriter, write_manifest

EXPERT = "layers.0.mlp.experts.3"


def _key(fqn: str, slot: str = "output.0", *, micro_batch: int = 0, call: int = 0, phase: str = "forward") -> TensorKey:
    return TensorKey(step=0, micro_batch=micro_batch, phase=phase, fqn=fqn, slot=slot, call=call)


def _rows(tokens: list[int], width: int = 4) -> torch.Tensor:
    """One row per token, a function of the token alone: rows of the same token agree in both runs."""
    return torch.tensor(tokens, dtype=torch.float32)[:, None] * 10 + torch.arange(width, dtype=torch.float32)


def _run(run_dir, tensors: dict[TensorKey, torch.Tensor]) -> RunReader:
    write_manifest(run_dir, RunManifest(role="reference", world_size=1))
    writer = RunWriter(run_dir, 0)
    writer.begin_step(0)
    for seq, (key, value) in enumerate(tensors.items()):
        writer.write(TensorMeta(key=key, rank=0, dtype=str(value.dtype).removeprefix("torch."),
                                local_shape=tuple(value.shape), layout=Layout.replicated(tuple(value.shape)), seq=seq), value)
    writer.end_step()
    return RunReader(run_dir)


def _expert(tokens: list[int] | None, rows: list[int] | None = None) -> dict[TensorKey, torch.Tensor]:
    """The expert's output and its fc1's output, one row per token of `rows` (default: `tokens`); its token
    positions unless `tokens` is None."""
    rows = tokens if rows is None else rows
    found = {_key(EXPERT): _rows(rows), _key(f"{EXPERT}.linear_fc1"): _rows(rows, 8)}
    if tokens is not None:
        found[_key(EXPERT, TOKENS_SLOT)] = torch.tensor(tokens, dtype=torch.int64)
    return found


REFERENCE_TOKENS, CANDIDATE_TOKENS = [1, 3, 4, 6], [1, 4, 5, 6, 7]
"""Token 3 went elsewhere in the candidate, tokens 5 and 7 came here from elsewhere: 1, 4 and 6 are common."""
NOTE = ("routed differently: 1 of the reference's 4 tokens went to another expert in the candidate, and 2 of the "
        "candidate's 5 came here from another; compared on the 3 tokens both sent here (the routing difference shows "
        "in the MoE layer's output)")


@pytest.fixture
def runs(tmp_path):
    with _run(tmp_path / "reference", _expert(REFERENCE_TOKENS)) as reference, \
            _run(tmp_path / "candidate", _expert(CANDIDATE_TOKENS)) as candidate:
        yield reference, candidate


@pytest.mark.parametrize("fqn", [EXPERT, f"{EXPERT}.linear_fc1"], ids=["the-expert", "inside-the-expert"])
def test_the_common_tokens_rows_are_aligned_in_each_runs_order(runs, fqn):
    """A module inside the expert has no token positions of its own: the nearest ancestor's apply."""
    reference, candidate = runs
    assert TOKENS_SLOT not in {key.slot for key in reference.index}  # the reader keeps positions apart
    aligned = token_alignment(_key(fqn), reference, candidate)
    assert aligned.reference_rows.tolist() == [0, 2, 3] and aligned.candidate_rows.tolist() == [0, 1, 3]
    assert aligned.note == NOTE
    ref_values = reference.read(reference.index[_key(fqn)][0])
    cand_values = candidate.read(candidate.index[_key(fqn)][0])
    assert torch.equal(ref_values[aligned.reference_rows], cand_values[aligned.candidate_rows])  # row i is token i's


def test_runs_that_share_no_token_align_no_row(tmp_path):
    with _run(tmp_path / "reference", _expert([0, 2])) as reference, _run(tmp_path / "candidate", _expert([1, 3, 5])) as candidate:
        aligned = token_alignment(_key(EXPERT), reference, candidate)
    assert aligned.reference_rows.tolist() == [] and aligned.candidate_rows.tolist() == []
    assert aligned.note.startswith("routed differently: 2 of the reference's 2 tokens went to another expert in the "
                                   "candidate, and 3 of the candidate's 3 came here from another; compared on the 0 tokens")


@pytest.mark.parametrize("reference_expert, candidate_expert", [
    (_expert(None, rows=REFERENCE_TOKENS), _expert(CANDIDATE_TOKENS)),
    (_expert(REFERENCE_TOKENS), _expert(None, rows=CANDIDATE_TOKENS)),
    (_expert(REFERENCE_TOKENS, rows=[1, 3, 4]), _expert(CANDIDATE_TOKENS)),
    (_expert(REFERENCE_TOKENS), _expert(CANDIDATE_TOKENS, rows=[1, 4, 5, 6, 7, 8])),
], ids=["reference-has-no-positions", "candidate-has-no-positions", "reference-rows-are-not-its-tokens",
        "candidate-rows-are-not-its-tokens"])
def test_no_alignment_without_both_runs_positions_or_with_rows_that_are_not_them(tmp_path, reference_expert,
                                                                                 candidate_expert):
    with _run(tmp_path / "reference", reference_expert) as reference, _run(tmp_path / "candidate", candidate_expert) as candidate:
        assert token_alignment(_key(EXPERT), reference, candidate) is None


def test_no_alignment_when_a_row_itself_differs_in_shape(tmp_path):
    """Rows of another width are not the same tensor routed differently."""
    wide = {_key(EXPERT): torch.zeros(5, 6)}
    with _run(tmp_path / "reference", _expert(REFERENCE_TOKENS)) as reference, \
            _run(tmp_path / "candidate", {**_expert(CANDIDATE_TOKENS), **wide}) as candidate:
        assert token_alignment(_key(EXPERT), reference, candidate) is None


def test_no_alignment_for_a_scalar(tmp_path):
    loss = _key(f"{EXPERT}.aux", "scalar.loss")
    with _run(tmp_path / "reference", {**_expert(REFERENCE_TOKENS), loss: torch.tensor(1.0)}) as reference, \
            _run(tmp_path / "candidate", {**_expert(CANDIDATE_TOKENS), loss: torch.tensor(2.0)}) as candidate:
        assert token_alignment(loss, reference, candidate) is None


def test_positions_of_another_call_or_micro_batch_do_not_apply(tmp_path):
    """Each call of an expert in each micro-batch holds its own tokens: the key's own call's positions only."""
    def run(tokens: list[int]) -> dict[TensorKey, torch.Tensor]:
        return {_key(EXPERT, call=1): _rows(tokens), _key(EXPERT, micro_batch=1): _rows(tokens),
                _key(EXPERT, TOKENS_SLOT): torch.tensor(tokens)}  # positions of call 0 of micro-batch 0 only

    with _run(tmp_path / "reference", run(REFERENCE_TOKENS)) as reference, \
            _run(tmp_path / "candidate", run(CANDIDATE_TOKENS)) as candidate:
        assert token_alignment(_key(EXPERT, call=1), reference, candidate) is None
        assert token_alignment(_key(EXPERT, micro_batch=1), reference, candidate) is None


def test_the_nearest_ancestors_positions_apply(tmp_path):
    """Positions recorded both for the expert and for the MoE layer above it (which holds every token): the
    expert's are used for the expert and below, never the layer's."""
    layer = "layers.0.mlp"
    every_token = {_key(layer, TOKENS_SLOT): torch.arange(8)}
    with _run(tmp_path / "reference", {**_expert(REFERENCE_TOKENS), **every_token}) as reference, \
            _run(tmp_path / "candidate", {**_expert(CANDIDATE_TOKENS), **every_token}) as candidate:
        aligned = token_alignment(_key(f"{EXPERT}.linear_fc1"), reference, candidate)
    assert aligned.note == NOTE


def test_as_many_rows_of_other_tokens_are_aligned_and_the_same_tokens_are_not(tmp_path):
    """One token left and another arrived: the row count holds, the rows are other tokens' (routed_apart)."""
    from ttrace_core.compare.routed_rows import routed_apart

    with _run(tmp_path / "reference", _expert([1, 3, 4])) as reference, \
            _run(tmp_path / "candidate", _expert([1, 4, 5])) as candidate, \
            _run(tmp_path / "same", _expert([1, 3, 4])) as same:
        aligned = token_alignment(_key(EXPERT), reference, candidate)
        assert aligned.reference_rows.tolist() == [0, 2] and aligned.candidate_rows.tolist() == [0, 1]
        assert routed_apart(_key(f"{EXPERT}.linear_fc1"), reference, candidate)
        assert token_alignment(_key(EXPERT), reference, same) is None and not routed_apart(_key(EXPERT), reference, same)
        assert not routed_apart(_key("layers.0.attention", "output.0"), reference, candidate)  # not routed
