import pytest

from ttrace_core.compare.engine import RunComparison, TensorComparison
from ttrace_core.localize.verdicts import Localization, can_replay_alone, module_verdicts, sync_findings
from ttrace_core.format.schema import NO_MICRO_BATCH, RunManifest, TensorKey


def comparison(phase: str, fqn: str, slot: str, passed: bool, micro_batch: int = 0, drift: dict | None = None) -> TensorComparison:
    micro_batch = NO_MICRO_BATCH if phase in ("grad", "param") else micro_batch
    key = TensorKey(step=0, micro_batch=micro_batch, phase=phase, fqn=fqn, slot=slot)
    status = "pass" if passed else ("replica_drift" if drift else "mismatch")
    return TensorComparison(key=key, status=status, error=0.0 if passed else 1.0, ratio=0.1 if passed else 50.0,
                            replica_drift=drift)


def run(*comparisons: TensorComparison) -> RunComparison:
    return RunComparison(reference="ref", candidate="cand", comparisons=list(comparisons))


def verdicts(replay: RunComparison, original: RunComparison | None = None) -> dict[str, tuple[str, str]]:
    return {v.fqn: (v.verdict, v.phase) for v in module_verdicts(original if original is not None else run(), replay)}


def test_the_deepest_module_failing_on_rewritten_inputs_is_the_culprit():
    replay = run(comparison("forward", "layer.attn.proj", "input.0", True), comparison("forward", "layer.attn.proj", "output.0", False),
                 comparison("forward", "layer.attn", "output.0", False), comparison("forward", "layer", "output.0", False),
                 comparison("forward", "layer.mlp", "output.0", True))
    result = verdicts(replay)
    assert result["layer.attn.proj"] == ("introduces error", "forward")
    assert result["layer.attn"][0] == result["layer"][0] == "inherits error"
    assert result["layer.mlp"] == ("clean", "")


def test_an_input_broken_between_modules_blames_the_parents_glue():
    # fc1 is right, fc2 computes right from the reference's input, but its own input was wrong:
    # the code in mlp between them (the GLU split) broke it.
    replay = run(comparison("forward", "layer.mlp", "input.0", True), comparison("forward", "layer.mlp.fc1", "output.0", True),
                 comparison("forward", "layer.mlp.fc2", "input.0", False), comparison("forward", "layer.mlp.fc2", "output.0", True),
                 comparison("forward", "layer.mlp", "output.0", True))
    assert verdicts(replay)["layer.mlp"] == ("introduces error", "forward glue")


def test_an_input_after_an_earlier_failure_is_inherited_and_glue_outside_every_module_is_named_by_its_neighbours():
    # Micro-batch 1: the loss (outside every traced module) sits between head's forward output and
    # head's first backward tensor; the verdict names both, never the model root.
    replay = run(comparison("forward", "a.proj", "output.0", False), comparison("forward", "b.norm", "input.0", False),
                 comparison("forward", "head", "output.0", True, micro_batch=1),
                 comparison("backward", "head", "grad_output.0", False, micro_batch=1))
    result = verdicts(replay)
    assert result["a.proj"][0] == "introduces error" and "b" not in result
    glue = "between head (forward output.0) and head (backward grad_output.0)"
    assert result[glue] == ("introduces error", "backward glue")
    assert not any(name in ("", "<root>") for name in result)


def test_glue_of_the_model_root_and_before_any_recorded_tensor_is_named_by_its_neighbours():
    # The root ("") is traced but owns only glue: the tensor after it and before it name the spot.
    replay = run(comparison("forward", "", "input.0", True), comparison("forward", "emb", "input.0", False),
                 comparison("forward", "emb", "output.0", True))
    assert verdicts(replay)["between the model (forward input.0) and emb (forward input.0)"][0] == "introduces error"
    first = run(comparison("forward", "emb", "input.0", False))
    assert verdicts(first)["between the micro-batch's data and emb (forward input.0)"][0] == "introduces error"


def test_modules_failing_only_before_rewriting_inherit():
    original = run(comparison("forward", "late", "output.0", False))
    assert verdicts(run(comparison("forward", "late", "output.0", True)), original)["late"] == ("inherits error", "")


def test_replicas_differing_along_tp_name_the_tp_reduction():
    manifest = RunManifest(role="candidate", world_size=2, degrees={"pp": 1, "dp": 1, "tp": 2, "sp": 1}, mesh_shape=[1, 1, 2],
                           mesh_axis_names=["pp", "dp", "tp"], rank_coordinates=[[0, 0, 0], [0, 0, 1]])
    drift = {"ranks": (0, 1), "max_abs_diff": 1.0, "relative_diff": 0.5}
    replay = run(comparison("forward", "norm", "output.0", True), comparison("grad", "norm.weight", "grad", False, drift=drift),
                 comparison("param", "norm.weight", "value", False))
    findings, wgrad = sync_findings(run(), replay, None, None, manifest, module_culprits=[])
    assert [(f.params, f.reduction, f.bug_class) for f in findings] == [(["norm.weight"], "TP (sequence parallel)", "gradient-sync")]
    assert wgrad == []


def test_an_updated_parameter_wrong_with_a_right_gradient_is_the_optimizer():
    manifest = RunManifest(role="candidate", world_size=2, degrees={"dp": 2})
    replay = run(comparison("grad", "w", "grad", True), comparison("param", "w", "value", False))
    findings, _ = sync_findings(run(), replay, None, None, manifest, module_culprits=[])
    assert [(f.reduction, f.bug_class) for f in findings] == [("optimizer", "optimizer")]


def test_localization_is_truthy_when_nothing_is_at_fault_and_round_trips():
    clean = Localization(reference="r", candidate="c", replay=None, diverged=False)
    assert clean and Localization.from_json(clean.to_json()) == clean
    faulty = Localization(reference="r", candidate="c", replay="p", diverged=True, culprits=["x"])
    assert not faulty


def test_a_one_module_replay_does_not_blame_its_own_boundary():
    # Only "layer.attn" was rewritten: its grad_output comes from unrewritten layers above it.
    replay = run(comparison("forward", "layer.attn.proj", "output.0", False),
                 comparison("backward", "layer.attn", "grad_output.0", False, micro_batch=1))
    result = {v.fqn: v.verdict for v in module_verdicts(run(), replay, root="layer.attn")}
    assert result == {"layer.attn.proj": "introduces error", "layer.attn": "clean"}



@pytest.mark.parametrize("failing, module, alone", [
    ((("forward", "layers.0.fc"),), "layers.0", True),                       # what the module computes: alone
    ((("grad", "final_norm.weight"),), "final_norm", False),                 # a reduction: only the whole model runs it
    ((("forward", "layers.0.fc"), ("param", "layers.0.fc.bias")), "layers.0", True),  # the update inherits it
    ((("grad", "final_norm.weight"),), "layers.0", False),                   # nothing of layers.0 fails
    ((("forward", "layers.0.fc"),), "final_norm.weight", False),             # a parameter is not a module
], ids=["activation", "reduction", "activation-and-update", "nothing-fails-here", "a-parameter"])
def test_a_module_is_replayed_alone_only_when_that_can_show_its_failure(failing, module, alone):
    passing = [comparison("forward", m, "output.0", True) for m in ("final_norm", "layers.0", "layers.0.fc")]
    failures = [comparison(phase, fqn, "grad" if phase == "grad" else "output.0", False) for phase, fqn in failing]
    assert can_replay_alone(run(*passing, *failures), module) is alone
