import torch
from torch import nn

from ttrace_core.compare.engine import compare_runs
from ttrace_core.record.rewrite import InputRewriter
from ttrace_core.format.reader import RunReader
from ttrace_core.record.tracer import Tracer


def _record(run_dir, *, bug: bool, rewrite_from=None) -> None:
    """A bf16 two-layer model; the bug triples the first layer's output."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)).to(torch.bfloat16)
    if bug:
        model[0].register_forward_hook(lambda module, args, output: output * 3)
    rewriter = InputRewriter(rewrite_from) if rewrite_from else None
    tracer = Tracer(run_dir, model, role="candidate" if bug else "reference", rewriter=rewriter)
    inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).requires_grad_()
    with tracer.step(0):
        model(inputs).float().square().mean().backward()
    tracer.close()


def test_a_rewritten_module_computes_from_the_reference_values_bitwise(tmp_path):
    _record(tmp_path / "ref", bug=False)
    _record(tmp_path / "replay", bug=True, rewrite_from=tmp_path / "ref")
    with RunReader(tmp_path / "ref") as ref, RunReader(tmp_path / "replay") as replay:
        by_name = {(c.key.phase, c.key.fqn, c.key.slot): c for c in compare_runs(ref, replay).comparisons}
    # the trace keeps the candidate's own (tripled) input of layer 1, but layer 1 computed from the
    # reference's: its output, and every gradient below it, equal the reference's bitwise
    assert not by_name["forward", "1", "input.0"] and not by_name["forward", "0", "output.0"]
    assert by_name["forward", "1", "output.0"].exact
    assert by_name["backward", "0", "grad_output.0"].exact
    assert by_name["backward", "1", "grad_input.0"].exact
