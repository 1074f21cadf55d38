"""canonicalize/token_rows.py and record/token_rows.py: a routed module's rows cut by source micro-batch and put in token order, and the
tracer recording them so (in-process, one rank)."""

import pytest
import torch
from torch import nn

from ttrace_core.format.reader import RunReader
from ttrace_core.canonicalize.token_rows import TokenRows
from ttrace_core.record.token_rows import RoutedTokens
from ttrace_core.record.tracer import Tracer

# (ids, tokens per micro-batch, micro-batches of the call) -> {micro-batch: rows in token order}
PIECES = {
    "one micro-batch, permuted": ([5, 1, 3], 8, (0,), {0: [1, 2, 0]}),
    "two micro-batches interleaved": ([9, 2, 8, 0], 8, (0, 1), {0: [3, 1], 1: [2, 0]}),
    "a micro-batch that sent nothing": ([17, 16], 8, (1, 2), {1: [], 2: [1, 0]}),
    "padding rows dropped": ([-1, 4, -1, 3], 8, (0,), {0: [3, 1]}),
    "no rows at all": ([], 8, (0, 1), {0: [], 1: []}),
}


@pytest.mark.parametrize("ids, per_micro_batch, micro_batches, expected", PIECES.values(), ids=list(PIECES))
def test_pieces_are_source_micro_batches_in_token_order(ids, per_micro_batch, micro_batches, expected):
    rows = TokenRows(ids=torch.tensor(ids, dtype=torch.int64), tokens_per_micro_batch=per_micro_batch,
                     micro_batches=micro_batches)
    assert {m: index.tolist() for m, expert, index in rows.pieces()} == expected


def test_rows_of_an_unlisted_micro_batch_are_refused():
    rows = TokenRows(ids=torch.tensor([3, 12]), tokens_per_micro_batch=8, micro_batches=(0,))
    with pytest.raises(ValueError, match=r"micro-batches \[1\]"):
        rows.pieces()


def test_a_module_inside_a_routed_root_shares_its_rows():
    routed = RoutedTokens(roots=frozenset({"mlp.experts.local_experts.1"}))
    rows = TokenRows(ids=torch.tensor([0]), tokens_per_micro_batch=4, micro_batches=(0,))
    routed.expect("mlp.experts.local_experts.1", 0, 0, rows)
    assert routed.rows_for("mlp.experts.local_experts.1.linear_fc1", 0, 0) is rows
    assert routed.rows_for("mlp.experts.local_experts.10", 0, 0) is None
    assert routed.rows_for("mlp.experts.local_experts.1", 1, 0) is None
    with pytest.raises(ValueError, match="not a routed module"):
        routed.expect("mlp.router", 0, 0, rows)


class _Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.linear(tokens)


class _Routed(nn.Module):
    """An 'expert' that receives tokens of micro-batches 0 and 1 in one call (as under expert parallelism)."""

    def __init__(self) -> None:
        super().__init__()
        self.expert = _Expert()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.expert(tokens)


def test_the_tracer_records_a_routed_call_per_source_micro_batch_in_token_order(tmp_path):
    model = _Routed()
    tracer = Tracer(tmp_path / "run", model, role="candidate")
    tracer.route_tokens(["expert"])
    tokens = torch.arange(12, dtype=torch.float32).reshape(4, 3).requires_grad_()
    # rows hold tokens (mb 1, pos 2), (mb 0, pos 3), (mb 1, pos 0), (mb 0, pos 1) of 4-token micro-batches
    ids = torch.tensor([6, 3, 4, 1])
    with tracer.step(0):
        tracer.routed.expect("expert", 0, 0, TokenRows(ids=ids, tokens_per_micro_batch=4, micro_batches=(0, 1, 2)))
        model(tokens).sum().backward()
    tracer.close()
    reader = RunReader(tmp_path / "run")
    values = {(k.micro_batch, k.fqn, k.slot): reader.read(metas[0]) for k, metas in reader.index.items()
              if k.fqn.startswith("expert") and k.phase == "forward"}
    reader.close()
    assert values[(0, "expert", "input.0")].tolist() == [tokens[3].tolist(), tokens[1].tolist()]
    assert values[(1, "expert", "input.0")].tolist() == [tokens[2].tolist(), tokens[0].tolist()]
    assert values[(2, "expert", "input.0")].shape == (0, 3)
    assert values[(0, "expert.linear", "output.0")].shape == (2, 2)


def test_a_call_of_several_experts_is_cut_per_expert_too():
    """torchtitan's grouped experts: rows for experts 2 and 3 of micro-batches 0 and 1, expert-major."""
    rows = TokenRows(ids=torch.tensor([1, 5, 0, 4]), tokens_per_micro_batch=4, micro_batches=(0, 1),
                     experts=torch.tensor([2, 2, 3, 3]), experts_held=(2, 3))
    assert [(m, e, index.tolist()) for m, e, index in rows.pieces()] == \
        [(0, 2, [0]), (0, 3, [2]), (1, 2, [1]), (1, 3, [3])]


@pytest.mark.parametrize("layout_shape, local_shape, expected", [
    (None, (2, 3), [[0, 1, 2], [3, 4, 5]]),
    # rank 1 of 2 holding the second half of dim 1 (sequence parallelism over [batch, sequence])
    ((2, 4), (2, 2), [[2, 3], [6, 7]]),
], ids=["whole", "sequence shard"])
def test_token_ids_follow_the_layout(layout_shape, local_shape, expected):
    from ttrace_core.format.schema import Layout
    from ttrace_core.canonicalize.token_rows import token_ids

    layout = None if layout_shape is None else Layout(global_shape=(*layout_shape, 8), mesh_shape=(2,), coordinate=(1,),
                                                      placements=("S(1)",), mesh_axis_names=("tp",))
    ids, per_micro_batch = token_ids(1, local_shape, layout)
    assert per_micro_batch == (6 if layout is None else 8)
    assert (ids - per_micro_batch).tolist() == expected


def test_routing_bookkeeping_of_a_routed_call_is_not_recorded(tmp_path):
    """An integer input that is not one row per token (tokens per expert) says nothing the pieces' shapes do not."""

    class Counted(nn.Module):
        def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            return tokens * 2

    model = Counted()
    tracer = Tracer(tmp_path / "run", model, role="candidate")
    tracer.route_tokens([""])
    with tracer.step(0):
        tracer.routed.expect("", 0, 0, TokenRows(ids=torch.tensor([1, 0]), tokens_per_micro_batch=2, micro_batches=(0,)))
        model(torch.ones(2, 3), torch.tensor([2]))
    tracer.close()
    with RunReader(tmp_path / "run") as reader:
        slots = {key.slot for key in reader.index if key.phase == "forward"}
    assert slots == {"input.0", "output.0"}


def _record_routed(run, ids: list[int], scale_row: int | None = None) -> None:
    """An expert that receives the tokens `ids` (of 4-token micro-batch 0); token t's row is t * [1, 1, 1]."""
    model = _Routed()
    with torch.no_grad():
        model.expert.linear.weight.fill_(0.5)
    tracer = Tracer(run, model, role="candidate")
    tracer.route_tokens(["expert"])
    tokens = torch.tensor(ids, dtype=torch.float32)[:, None].repeat(1, 3)
    if scale_row is not None:
        tokens[scale_row] *= 1.5
    with tracer.step(0):
        tracer.routed.expect("expert", 0, 0, TokenRows(ids=torch.tensor(ids), tokens_per_micro_batch=4, micro_batches=(0,)))
        model(tokens)
    tracer.close()


@pytest.mark.parametrize("candidate_ids, wrong_row, passes", [
    ([3, 0, 1], None, True),   # token 2 went elsewhere in the candidate: the 3 common tokens agree
    ([3, 0, 1], 0, False),     # ... but common token 3 holds other values
], ids=["routing differs, common tokens agree", "a common token differs"])
def test_an_expert_routed_other_tokens_is_compared_on_the_common_ones(tmp_path, candidate_ids, wrong_row, passes):
    from ttrace_core.compare.engine import compare_runs

    _record_routed(tmp_path / "reference", [2, 0, 3, 1])
    _record_routed(tmp_path / "candidate", candidate_ids, wrong_row)
    with RunReader(tmp_path / "reference") as reference, RunReader(tmp_path / "candidate") as candidate:
        assert all(key.slot != "tokens" for key in candidate.index) and candidate.tokens
        result = compare_runs(reference, candidate)
    rows = {(c.key.fqn, c.key.slot): c for c in result.comparisons if c.key.phase == "forward"}
    expert_input = rows[("expert", "input.0")]
    assert "routed differently: 1 of the reference's 4 tokens" in expert_input.message
    assert bool(expert_input) is passes and bool(rows[("expert.linear", "output.0")]) is passes


@pytest.mark.parametrize("candidate_ids, wrong_row, passes", [
    ([1, 0, 3], None, True),   # token 2 went elsewhere and token 1 came here: as many rows, 2 common tokens agree
    ([1, 0, 3], 2, False),     # ... but common token 3 holds other values
    ([2, 0, 3], None, True),   # the same tokens: compared row by row, with no note
], ids=["as many rows, other tokens", "a common token differs", "the same tokens"])
def test_an_expert_sent_as_many_other_tokens_is_compared_on_the_common_ones(tmp_path, candidate_ids, wrong_row, passes):
    """A token that left and another that arrived leave the row count as it was (torchtitan's qwen3 MoE under TP2:
    row by row, two runs' rows of other tokens read as a bug of order 1)."""
    from ttrace_core.compare.engine import compare_runs

    _record_routed(tmp_path / "reference", [2, 0, 3])
    _record_routed(tmp_path / "candidate", candidate_ids, wrong_row)
    with RunReader(tmp_path / "reference") as reference, RunReader(tmp_path / "candidate") as candidate:
        result = compare_runs(reference, candidate)
    rows = {(c.key.fqn, c.key.slot): c for c in result.comparisons if c.key.phase == "forward"}
    expert_input = rows[("expert", "input.0")]
    routed_apart = candidate_ids != [2, 0, 3]
    assert ("routed differently: 1 of the reference's 3 tokens went to another expert in the candidate, and 1 of the "
            "candidate's 3 came here" in (expert_input.message or "")) is routed_apart
    assert bool(expert_input) is passes and bool(rows[("expert.linear", "output.0")]) is passes
