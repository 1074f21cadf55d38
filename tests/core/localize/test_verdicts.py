import pytest
import torch

from ttrace_core.canonicalize.replicas import ReplicaDrift
from ttrace_core.compare.engine import RunComparison, TensorComparison
from ttrace_core.errors import TtraceError
from ttrace_core.format.naming import GRADIENT_CLIPPING, LOSS_FUNCTION
from ttrace_core.format.reader import RunReader
from ttrace_core.format.writer import RunWriter, write_manifest
from ttrace_core.localize.verdicts import Localization, analyze, can_replay_alone, module_verdicts, sync_findings
from ttrace_core.format.schema import NO_MICRO_BATCH, Layout, RunManifest, TensorKey, TensorMeta
from ttrace_core.workflows.localize import localize


def comparison(phase: str, fqn: str, slot: str, passed: bool, micro_batch: int = 0, drift: ReplicaDrift | None = None) -> TensorComparison:
    micro_batch = NO_MICRO_BATCH if phase in ("grad", "step", "param") else micro_batch
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
    # Micro-batch 1: code outside every traced module (the schedule) sits between head's backward and
    # body's; the verdict names both, never the model root.
    replay = run(comparison("forward", "a.proj", "output.0", False), comparison("forward", "b.norm", "input.0", False),
                 comparison("forward", "head", "output.0", True, micro_batch=1),
                 comparison("backward", "head", "grad_input.0", True, micro_batch=1),
                 comparison("backward", "body", "grad_output.0", False, micro_batch=1))
    result = verdicts(replay)
    assert result["a.proj"][0] == "introduces error" and "b" not in result
    glue = "between head (backward grad_input.0) and body (backward grad_output.0)"
    assert result[glue] == ("introduces error", "backward glue")
    assert not any(name in ("", "<root>") for name in result)


def test_glue_of_the_model_root_and_before_any_recorded_tensor_is_named_by_its_neighbours():
    # The root ("") is traced but owns only glue: the tensor after it and before it name the spot.
    replay = run(comparison("forward", "", "input.0", True), comparison("forward", "emb", "input.0", False),
                 comparison("forward", "emb", "output.0", True))
    assert verdicts(replay)["between the model (forward input.0) and emb (forward input.0)"][0] == "introduces error"
    first = run(comparison("forward", "emb", "input.0", False))
    assert verdicts(first)["between the micro-batch's data and emb (forward input.0)"][0] == "introduces error"


def test_the_model_root_inherits_the_error_of_a_module_inside_it():
    """The root module ("") holds every module (format.naming in_subtree): it inherits, never a second culprit."""
    replay = run(comparison("forward", "emb", "output.0", False), comparison("forward", "", "output.0", False))
    result = verdicts(replay)
    assert result["emb"] == ("introduces error", "forward") and result[""] == ("inherits error", "")


def test_modules_failing_only_before_rewriting_inherit():
    original = run(comparison("forward", "late", "output.0", False))
    assert verdicts(run(comparison("forward", "late", "output.0", True)), original)["late"] == ("inherits error", "")


def test_replicas_differing_along_tp_name_the_tp_reduction():
    manifest = RunManifest(role="candidate", world_size=2, degrees={"pp": 1, "dp": 1, "tp": 2, "sp": 1}, mesh_shape=[1, 1, 2],
                           mesh_axis_names=["pp", "dp", "tp"], rank_coordinates=[[0, 0, 0], [0, 0, 1]])
    drift = ReplicaDrift(ranks=(0, 1), max_abs_diff=1.0, relative_diff=0.5)
    replay = run(comparison("forward", "norm", "output.0", True), comparison("grad", "norm.weight", "grad", False, drift=drift),
                 comparison("param", "norm.weight", "value", False))
    findings, wgrad = sync_findings(run(), replay, None, None, manifest, module_culprits=[])
    assert [(f.params, f.reduction, f.bug_class) for f in findings] == [(["norm.weight"], "TP (sequence parallel)", "gradient-sync")]
    assert wgrad == []


@pytest.mark.parametrize("axis_names", [["dp", "tp"], ["fsdp", "tp"], ["dp_shard", "tp"], ["dp_replicate", "tp"],
                                        ["hsdp", "tp"]], ids=["dp", "fsdp", "dp_shard", "dp_replicate", "hsdp"])
def test_replicas_differing_along_any_data_parallel_axis_name_the_dp_reduction(axis_names):
    """torchtitan names its axes dp_shard and dp_replicate: an unreduced gradient there is DP's, not "unknown"."""
    manifest = RunManifest(role="candidate", world_size=4, degrees={axis_names[0]: 2, "tp": 2}, mesh_shape=[2, 2],
                           mesh_axis_names=axis_names, rank_coordinates=[[0, 0], [0, 1], [1, 0], [1, 1]])
    drift = ReplicaDrift(ranks=(0, 2), max_abs_diff=1.0, relative_diff=0.5)
    replay = run(comparison("forward", "norm", "output.0", True), comparison("grad", "norm.weight", "grad", False, drift=drift))
    findings, _ = sync_findings(run(), replay, None, None, manifest, module_culprits=[])
    assert [(f.reduction, f.bug_class) for f in findings] == [("DP", "gradient-sync")]


@pytest.mark.parametrize("degrees, expected", [
    ({"dp": 2, "tp": 2}, 2), ({"dp_shard": 2, "dp_replicate": 2, "tp": 2}, 4), ({"tp": 4}, 1), ({}, 1),
    ({"fsdp": 4, "pp": 2}, 4),
], ids=["dp", "torchtitan hsdp", "tp only", "none", "fsdp"])
def test_data_parallel_degree_reads_every_data_parallel_axis(degrees, expected):
    from ttrace_core.format.naming import data_parallel_degree

    assert data_parallel_degree(degrees) == expected


@pytest.mark.parametrize("degrees", [{"dp": 2}, {"fsdp": 2}, {"dp_shard": 2}, {"dp_replicate": 2}, {"dp_shard": 2, "tp": 2}],
                         ids=["dp", "fsdp", "dp_shard", "dp_replicate", "dp_shard-tp"])
def test_a_gradient_off_by_a_constant_factor_under_any_data_parallel_axis_is_dp_scaling(monkeypatch, degrees):
    """torchtitan's dp_shard / dp_replicate degrees reach the DP-scaling class (it read only dp, fsdp and ep)."""
    from ttrace_core.localize import verdicts

    monkeypatch.setattr(verdicts, "_scale_factor", lambda reference, replay, key: (2.0, 0.0))
    manifest = RunManifest(role="candidate", world_size=2 * degrees.get("tp", 1), degrees=degrees)
    replay = run(comparison("forward", "fc", "output.0", True), comparison("grad", "fc.weight", "grad", False))
    findings, wgrad = sync_findings(run(), replay, None, None, manifest, module_culprits=[])
    assert [(f.reduction, f.bug_class) for f in findings] == [("DP", "scaling")] and wgrad == []


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
    ((("forward", LOSS_FUNCTION),), LOSS_FUNCTION, False),                   # nor is the loss function
], ids=["activation", "reduction", "activation-and-update", "nothing-fails-here", "a-parameter", "the-loss"])
def test_a_module_is_replayed_alone_only_when_that_can_show_its_failure(failing, module, alone):
    passing = [comparison("forward", m, "output.0", True) for m in ("final_norm", "layers.0", "layers.0.fc")]
    failures = [comparison(phase, fqn, "grad" if phase == "grad" else "output.0", False) for phase, fqn in failing]
    assert can_replay_alone(run(*passing, *failures), module) is alone


# A model traced as megatron's is: output_layer forward-only (no backward hook, so a replay does not
# rewrite its grad_output), the hooked modules' grad_outputs rewritten to the reference's.
FORWARD_ONLY = RunManifest(role="candidate", world_size=1, tracer={"forward_only": ["output_layer"]})
MODULES = ("emb", "final_norm", "output_layer")


def _loss_bug(*, loss_recorded: bool) -> RunComparison:
    """The replay of a loss-function bug: every forward tensor passes, the loss fails, every gradient a
    module received and every weight gradient fails (a hooked module's grad_input, computed from the
    reference's grad_output, passes). An older trace records neither the loss nor output_layer's grad_output."""
    forward = [comparison("forward", m, slot, True) for m in MODULES for slot in ("input.0", "output.0")]
    loss = [comparison("forward", LOSS_FUNCTION, "scalar.loss", False),
            comparison("backward", "output_layer", "grad_output.0", False)] if loss_recorded else []
    backward = [comparison("backward", "final_norm", "grad_output.0", False),
                comparison("backward", "final_norm", "grad_input.0", True),
                comparison("backward", "emb", "grad_output.0", False)]
    updates = [comparison(phase, f"{m}.weight", slot, False) for phase, slot in (("grad", "grad"), ("param", "value"))
               for m in MODULES]
    return run(*forward, *loss, *backward, *updates)


@pytest.mark.parametrize("loss_recorded, phase, failing", [
    (True, "forward", "the loss (scalar.loss) fails"),
    (False, "backward", "no loss is recorded and the backward's first gradient, final_norm (backward grad_output.0),"),
], ids=["loss-recorded", "older-trace"])
def test_a_loss_bug_names_only_the_loss_function_never_a_weight_gradient_it_received(loss_recorded, phase, failing):
    replay = _loss_bug(loss_recorded=loss_recorded)
    result = analyze(replay, replay, None, None, FORWARD_ONLY)
    assert result.culprits == ["the loss function"] and result.sync == [] and result.bug_class == phase
    (culprit,) = [m for m in result.modules if m.verdict == "introduces error"]
    assert culprit.fqn == LOSS_FUNCTION
    assert failing in culprit.detail and "A replay cannot rewrite the loss's inputs" in culprit.detail
    assert "output_layer (forward output.0), which the loss is computed from, passes" in culprit.detail


def test_the_loss_and_the_backward_it_starts_inherit_a_wrong_last_forward_output():
    replay = run(comparison("forward", "output_layer", "input.0", True),
                 comparison("forward", "output_layer", "output.0", False),
                 comparison("forward", LOSS_FUNCTION, "scalar.loss", False),
                 comparison("backward", "output_layer", "grad_output.0", False),
                 comparison("backward", "final_norm", "grad_output.0", False))
    assert [fqn for fqn, (verdict, _) in verdicts(replay).items() if verdict == "introduces error"] == ["output_layer"]


def test_a_wrong_gradient_norm_with_right_gradients_names_the_clipping_and_explains_the_update():
    replay = run(comparison("forward", "fc", "output.0", True),
                 comparison("backward", "fc", "grad_output.0", True),
                 comparison("grad", "fc.weight", "grad", True), comparison("grad", "fc.bias", "grad", True),
                 comparison("step", GRADIENT_CLIPPING, "scalar.grad_norm", False),
                 comparison("step", GRADIENT_CLIPPING, "scalar.lr", True),
                 comparison("param", "fc.weight", "value", False), comparison("param", "fc.bias", "value", False))
    result = analyze(replay, replay, None, None, FORWARD_ONLY)
    assert result.culprits == ["the gradient norm / clipping"] and result.sync == [] and result.bug_class == "step"


def _gradient_runs(root, key: TensorKey, expected: torch.Tensor, actual: torch.Tensor) -> tuple[RunReader, RunReader]:
    for role, value in (("reference", expected), ("candidate", actual)):
        write_manifest(root / role, RunManifest(role=role, world_size=1))
        writer = RunWriter(root / role, 0)
        writer.begin_step(0)
        writer.write(TensorMeta(key=key, rank=0, dtype="float32", local_shape=tuple(value.shape),
                                layout=Layout.replicated(tuple(value.shape)), seq=0), value)
        writer.end_step()
    return RunReader(root / "reference"), RunReader(root / "candidate")


@pytest.mark.parametrize("module, root, received_passes", [
    ("output_layer", None, True),  # forward-only: it computed from the grad_output it recorded, which passes
    ("fc", "fc", False),  # replayed alone: it recorded what came from outside, and computed from the reference's
], ids=["forward-only", "replayed-alone"])
def test_a_module_that_computed_from_a_right_gradient_is_named_for_its_weight_gradient(tmp_path, module, root,
                                                                                     received_passes):
    key = TensorKey(step=0, micro_batch=NO_MICRO_BATCH, phase="grad", fqn=f"{module}.weight", slot="grad")
    expected = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    replay = run(comparison("forward", module, "input.0", received_passes),
                 comparison("forward", module, "output.0", True),
                 comparison("backward", module, "grad_output.0", received_passes),
                 comparison("grad", key.fqn, "grad", False))
    reference, replay_reader = _gradient_runs(tmp_path, key, expected, expected + torch.eye(4))
    with reference, replay_reader:
        result = analyze(replay, replay, reference, replay_reader, FORWARD_ONLY, root=root)
    assert result.culprits == [module] and result.bug_class == "backward (weight gradient)"


def test_localize_refuses_to_replay_a_pseudo_module(tmp_path):
    with pytest.raises(TtraceError, match="the loss function is no module"):
        localize(tmp_path / "reference", tmp_path / "candidate", module=LOSS_FUNCTION)


@pytest.mark.parametrize(("unfed", "culprit"), [
    (frozenset(), "attn.core.softmax"),
    (frozenset({"forward/attn.core.softmax/input.0"}), "attn.core"),
    (frozenset({"forward/attn.core.softmax/input.0", "forward/attn.core/input.0"}), "attn"),
], ids=["all-fed", "softmax-unfed", "softmax-and-core-unfed"])
def test_a_module_the_replay_could_not_feed_is_judged_by_its_nearest_fed_ancestor(unfed, culprit):
    """Against a reference of another implementation some inputs have no counterpart (queries after rotary):
    the replay leaves them the candidate's, so a module computing from one is not judged on its own."""
    replay = run(comparison("forward", "attn", "input.0", True), comparison("forward", "attn.qkv", "output.0", True),
                 comparison("forward", "attn.core.softmax", "output.0", False), comparison("forward", "attn.core", "output.0", False),
                 comparison("forward", "attn", "output.0", True))
    result = {v.fqn: v.verdict for v in module_verdicts(run(), replay, unfed=unfed)}
    assert [fqn for fqn, verdict in result.items() if verdict == "introduces error"] == [culprit]
    assert result["attn.qkv"] == "clean"


def test_a_backward_computed_from_unfed_forward_inputs_goes_to_the_fed_ancestor():
    replay = run(comparison("backward", "attn", "grad_output.0", True), comparison("backward", "attn.core", "grad_output.0", True),
                 comparison("backward", "attn.core", "grad_input.2", False))
    unfed = frozenset({"forward/attn.core/input.0"})
    result = {v.fqn: (v.verdict, v.phase) for v in module_verdicts(run(), replay, unfed=unfed)}
    assert result["attn"] == ("introduces error", "backward") and result["attn.core"] == ("clean", "")
