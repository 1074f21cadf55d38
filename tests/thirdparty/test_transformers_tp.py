"""Hugging Face Transformers' own tensor parallelism, traced with the README's lines only.

tests/thirdparty/hf_tp_train.py builds a tiny Llama and a tiny Qwen3-MoE from config, saves them,
and loads them with `from_pretrained(..., distributed_config=DistributedConfig(tp_size=2))`: the
model's own `base_model_tp_plan`, run by transformers' own parallel styles. A correct TP2 run must
pass against one rank; a rowwise module whose all-reduce TP rank 1 drops must fail there, and
localize must name it. The style table (integrations/transformers.py) must cover every style the
installed transformers registers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_support import ttrace_command
from tests.support.bounded_pair import same_rows

# Imported, not skipped when missing: requirements.txt pins them, and CI must never pass this tier by skipping it.
import accelerate  # noqa: E402,F401 - from_pretrained with a distributed config needs it
import transformers  # noqa: E402

SCRIPT = Path(__file__).parent / "hf_tp_train.py"
BUGGY_MODULE = "model.layers.1.mlp.down_proj"


def _record(root: Path, name: str, nproc: int, *flags: str) -> None:
    command = ["torchrun", "--standalone", "--nproc-per-node", str(nproc), str(SCRIPT), *flags]
    done = ttrace_command("record", "--out", name, "--timeout", "240", "--", *command, cwd=root, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def _compare(root: Path, reference: str, candidate: str) -> tuple[int, str, list[dict]]:
    report = root / f"{candidate}.json"
    done = ttrace_command("compare", reference, candidate, "--json", str(report), cwd=root, timeout=300)
    rows = json.loads(report.read_text())["comparisons"] if report.exists() else []
    return done.returncode, done.stdout, rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf_tp")
    _record(root, "llama-ref", 1, "--arch", "llama")
    _record(root, "llama-tp2", 2, "--arch", "llama", "--tp", "2")
    # One micro-batch per step: transformers 5.24 all-reduces q_norm / k_norm gradients at every
    # accumulation (see docs/transformers.md), which ttrace reports; here the run must be correct.
    _record(root, "moe-ref", 1, "--arch", "qwen3_moe", "--micro-batches", "1")
    _record(root, "moe-tp2", 2, "--arch", "qwen3_moe", "--tp", "2", "--micro-batches", "1")
    return root


@pytest.mark.distributed
def test_the_integration_is_the_readme_lines():
    lines = [line.strip() for line in SCRIPT.read_text().splitlines() if "ttrace" in line and not line.startswith(("#", '"'))]
    code = [line for line in lines if not line.startswith(("`", "torchrun"))]
    assert code == ["import ttrace_core as ttrace",
                    "session = ttrace.attach(model, optimizer, loss_scale=args.dp / args.micro_batches)"]
    assert "with session.step(step):" in SCRIPT.read_text() and "declare" not in SCRIPT.read_text()


@pytest.mark.distributed
def test_dense_tp2_passes_with_every_module_compared(runs):
    code, out, rows = _compare(runs, "llama-ref", "llama-tp2")
    assert code == 0, out[-3000:]
    compared = {(r["key"]["fqn"], r["key"]["slot"]) for r in rows}
    # colwise outputs, rowwise inputs, and the activation between them (no rule names it)
    assert {("model.layers.0.self_attn.q_proj", "output.0"), ("model.layers.0.self_attn.o_proj", "input.0"),
            ("model.layers.0.mlp.act_fn", "input.0"), ("model.layers.0.mlp.act_fn", "output.0"),
            ("model.layers.0.mlp.act_fn", "grad_input.0")} <= compared
    assert len(rows) > 600
    # Under a 1 MiB budget (bounded.py), its column- and row-sharded weights are cut at their shards' bounds, and the
    # table equals the whole one row for row.
    report = runs / "llama-tp2-bounded.json"
    done = ttrace_command("compare", "llama-ref", "llama-tp2", "--max-memory", "1M", "--rebuild", "--json", str(report),
                          cwd=runs, timeout=300)
    assert done.returncode == 0 and same_rows(json.loads(report.read_text()), {"comparisons": rows}), done.stdout[-2000:]


@pytest.mark.distributed
def test_qwen3_moe_tp2_passes_with_per_head_norms_and_expert_activations(runs):
    code, out, rows = _compare(runs, "moe-ref", "moe-tp2")
    assert code == 0, out[-3000:]
    compared = {(r["key"]["fqn"], r["key"]["slot"]) for r in rows}
    assert {("model.layers.0.self_attn.q_norm", "input.0"), ("model.layers.0.self_attn.k_norm", "output.0"),
            ("model.layers.0.mlp.experts.act_fn", "input.0"), ("model.layers.0.mlp.experts", "output.0"),
            ("model.layers.0.self_attn.q_norm.weight", "grad"),
            ("model.layers.0.mlp.experts.gate_up_proj", "grad")} <= compared


@pytest.mark.distributed
def test_qwen3_moe_tp2_x_ep2_passes_with_the_experts_weights_and_gradients_compared(runs):
    """transformers' own expert parallelism (AllReduceEP, the EP group sharing one batch): the experts'
    parameters are DTensors S(0) on the ep mesh, their inner modules are left out (said in a note)."""
    _record(runs, "moe-ep2", 2, "--arch", "qwen3_moe", "--tp", "2", "--ep", "2", "--ep-implementation", "all_reduce",
            "--micro-batches", "1")
    code, out, rows = _compare(runs, "moe-ref", "moe-ep2")
    assert code == 0, out[-3000:]
    compared = {(r["key"]["fqn"], r["key"]["slot"]) for r in rows}
    assert {("model.layers.0.mlp.experts", "output.0"), ("model.layers.0.mlp.experts.gate_up_proj", "grad"),
            ("model.layers.1.mlp.gate.weight", "grad")} <= compared
    assert not any(fqn == "model.layers.0.mlp.experts.act_fn" for fqn, _ in compared)
    assert "exclude_activations" in out


@pytest.mark.distributed
def test_gemma3_tp2_passes_with_its_norms_on_transposed_heads_compared(runs):
    """Gemma 3 normalizes each head after moving the heads in front of the sequence (`view(...).transpose(1, 2)`):
    the norm's input is a permuted view of the colwise q_proj's shard, its heads still cut (two of four per rank;
    k_norm's one of two, a view torch calls contiguous). One micro-batch: with more, transformers all-reduces the
    norms' gradients at every accumulation, the bug docs/transformers.md describes."""
    _record(runs, "gemma-ref", 1, "--arch", "gemma3", "--micro-batches", "1", "--steps", "1")
    _record(runs, "gemma-tp2", 2, "--arch", "gemma3", "--tp", "2", "--micro-batches", "1", "--steps", "1")
    code, out, rows = _compare(runs, "gemma-ref", "gemma-tp2")
    assert code == 0, out[-3000:]
    compared = {(r["key"]["fqn"], r["key"]["slot"]) for r in rows}
    assert {(f"model.layers.{layer}.self_attn.{norm}", slot) for layer in (0, 1) for norm in ("q_norm", "k_norm")
            for slot in ("input.0", "output.0", "grad_input.0")} <= compared
    assert "unrecorded" not in out


@pytest.mark.distributed
def test_a_dropped_all_reduce_fails_and_localize_names_its_module(runs):
    _record(runs, "llama-bug", 2, "--arch", "llama", "--tp", "2", "--bug", f"skip-reduction:{BUGGY_MODULE}")
    code, out, _ = _compare(runs, "llama-ref", "llama-bug")
    assert code == 1 and f"{BUGGY_MODULE} / output.0" in out.split("first divergence", 1)[1][:800], out[-3000:]
    localized = ttrace_command("localize", "llama-ref", "llama-bug", "--json", "loc.json", cwd=runs, timeout=500)
    assert localized.returncode == 1, localized.stdout[-2000:] + localized.stderr[-2000:]
    assert json.loads((runs / "loc.json").read_text())["culprits"] == [BUGGY_MODULE]


# ---- the style table: no process group needed ------------------------------------------------------

def _registered_styles() -> dict[str, object]:
    import transformers.distributed.expert_parallel  # noqa: F401 - registers the EP styles
    import transformers.distributed.tensor_parallel  # noqa: F401
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    return {name: ALL_PARALLEL_STYLES[name] for name in ALL_PARALLEL_STYLES}


def test_every_style_of_the_installed_transformers_has_layouts():
    from ttrace_core.integrations.transformers import boundary_placements, parameter_placement

    styles = _registered_styles()
    assert len(styles) >= 20
    unknown = [name for name, style in styles.items()
               if boundary_placements(style) is None or parameter_placement(style, "weight", 2) is None]
    assert unknown == []


def _strings(placements: dict, shape=(2, 32, 64)) -> dict[str, str]:
    return {slot: p(shape) if callable(p) else p for slot, p in placements.items()}


@pytest.mark.parametrize(("name", "boundary", "weight", "bias"), [
    ("colwise", {"input.0": "R", "output.0": "S(2)"}, "S(0)", "S(0)"),
    ("colwise_gather_output", {"input.0": "R", "output.0": "R"}, "S(0)", "S(0)"),
    ("rowwise", {"input.0": "S(2)", "output.0": "R"}, "S(1)", "R"),
    ("rowwise_rep", {"input.0": "R", "output.0": "R"}, "S(1)", "R"),
    ("packed_colwise", {"input.0": "R", "output.0": "SS(2,2)"}, "SS(0,2)", "S(0)"),
    ("packed_rowwise", {}, "SS(1,2)", "R"),
    ("embedding_rowwise", {"input.0": "R", "output.0": "R"}, "S(0)", "S(0)"),
    ("embedding_colwise", {"input.0": "R", "output.0": "R"}, "S(1)", "S(1)"),
    ("sequence_parallel", {"input.0": "S(1)", "output.0": "S(1)"}, "R", "R"),
    ("replicated_with_grad_allreduce", {}, "R", "R"),
    ("moe_tp_experts", {"input.0": "R", "output.0": "R"}, "R", "R"),
    ("moe_identity_expert", {"input.0": "R", "output.0": "P(sum)"}, "R", "R"),
    ("all_reduce", {"output.0": "R"}, "R", "R"),
    ("grouped_gemm", {}, "S(0)", "S(0)"),
    ("ep_dispatch_experts", {}, "R", "R"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_style_layouts(name, boundary, weight, bias):
    from ttrace_core.integrations.transformers import boundary_placements, parameter_placement

    style = _registered_styles()[name]
    assert _strings(boundary_placements(style)) == boundary
    assert (parameter_placement(style, "weight", 2), parameter_placement(style, "bias", 1)) == (weight, bias)


def test_an_unknown_style_is_a_finding_naming_it():
    from ttrace_core.integrations.transformers import AppliedPlan, PlannedTensor, boundary_placements, declarations
    from ttrace_core.errors import LayoutError

    class MyStyle:
        pass

    planned = PlannedTensor("model.layers.0.mlp", "my_style", MyStyle(), ((2,), (0,), ("tp",)))
    assert boundary_placements(MyStyle()) is None
    declared = list(declarations(AppliedPlan((planned,), ())))
    assert [(name, slot) for name, slot, _, _ in declared] == [("model.layers.0.mlp", "input.*"),
                                                              ("model.layers.0.mlp", "output.*")]
    with pytest.raises(LayoutError, match="parallel style 'my_style' \\(MyStyle\\)"):
        declared[0][2]((2, 4))


def test_ttrace_imports_without_transformers():
    code = ("import sys; sys.modules['transformers'] = None; import ttrace_core; "
            "from ttrace_core.record.session import _adapter_for; "
            "from ttrace_core.integrations.transformers import is_transformers_parallel_model as f; "
            "import torch; print(f(torch.nn.Linear(2, 2)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]


def test_expert_parallel_experts_leave_their_inner_activations_out_but_not_their_own():
    """Under `ep_dispatch_experts` the experts' inner modules (act_fn) compute on the rows this rank's EP
    implementation brought them: a correct TP2 x EP2 Qwen3-MoE run failed there by replica drift (1.4e5)
    until they were left out. The experts' own input and output (this rank's batch) stay traced."""
    import fnmatch

    from ttrace_core.integrations.transformers import AppliedPlan, PlannedTensor

    styles = _registered_styles()
    plan = AppliedPlan((PlannedTensor("model.layers.0.mlp.experts", "ep_dispatch_experts", styles["ep_dispatch_experts"], None),
                        PlannedTensor("model.layers.0.self_attn.q_proj", "colwise", styles["colwise"], None)), ())
    assert plan.expert_parallel_internals == ("model.layers.0.mlp.experts.?*",)
    left_out = [name for name in ("model.layers.0.mlp.experts", "model.layers.0.mlp.experts.act_fn", "model.layers.0.mlp.gate")
                if any(fnmatch.fnmatchcase(name, glob) for glob in plan.expert_parallel_internals)]
    assert left_out == ["model.layers.0.mlp.experts.act_fn"]
    tensor_parallel = AppliedPlan((PlannedTensor("model.layers.0.mlp.experts", "moe_tp_experts", styles["moe_tp_experts"], None),), ())
    assert tensor_parallel.expert_parallel_internals == ()
