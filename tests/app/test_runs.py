from ttrace_dashboard.runs import default_pair, matching_reference
from ttrace_core.api import RunInfo

MODEL = {"num_layers": 2}
RUNS = [
    RunInfo(path="bf16/reference", role="reference", precision="bf16", model=MODEL),
    RunInfo(path="fp32/reference", role="reference", precision="fp32", model=MODEL),
    RunInfo(path="fp32/clean", role="candidate", precision="fp32", model=MODEL),
    RunInfo(path="fp32/bug", role="candidate", precision="fp32", model=MODEL, bug="row-parallel-bias-per-rank"),
    RunInfo(path="other/reference", role="reference", precision="fp32", model={"num_layers": 4}),
    RunInfo(path="broken", role="candidate", error="unreadable"),
]


def test_a_candidate_gets_the_reference_of_its_model_and_precision():
    assert matching_reference(RUNS, RUNS[2]).path == "fp32/reference"
    assert matching_reference(RUNS, RunInfo(path="x", role="candidate", precision="bf16", model=MODEL)).path == "bf16/reference"
    assert matching_reference(RUNS, RunInfo(path="y", role="candidate", precision="fp32", model={"other": 1})) is None


def test_the_first_visit_lands_on_a_buggy_candidate_and_the_url_wins_otherwise():
    assert default_pair(RUNS, None, None) == ("fp32/reference", "fp32/bug")
    assert default_pair(RUNS, "bf16/reference", "fp32/clean") == ("bf16/reference", "fp32/clean")
    assert default_pair(RUNS, "../../etc", "broken") == ("fp32/reference", "fp32/bug")
    # a link with the roles swapped shows a real pair (the page says why), never a candidate as the reference
    assert default_pair(RUNS, "fp32/clean", "fp32/reference") == ("fp32/reference", "fp32/bug")


def test_the_runs_page_lists_blind_spots_and_estimates_for_other_precisions(tmp_path):
    import torch
    from torch import nn

    from ttrace_dashboard.runs import metadata_rows
    from ttrace_core import api
    from ttrace_core.record.tracer import Tracer, TracerConfig

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    tracer = Tracer(tmp_path, model, role="reference", config=TracerConfig(forward_only=("1",)))
    with tracer.step(0):
        model(torch.randn(2, 4)).sum().backward()
    tracer.close()
    (tmp_path / "tolerance_estimate.fp8.json").write_text("{}")
    rows = metadata_rows(api.run_info(tmp_path))
    assert rows["blind spots"].startswith("1: backward not hooked (tracer configuration: forward_only)")
    assert rows["tolerance estimate"] == "no; for fp8 candidates"
    assert rows["complete steps"] == "1 (step 0)" and rows["partial steps"] == "none"  # a count, not a bare "0"


def test_steps_are_counted_before_they_are_listed():
    from ttrace_dashboard.runs import _steps_text

    assert [_steps_text(s) for s in ([], [0], [0, 1, 3])] == ["none", "1 (step 0)", "3 (steps 0, 1, 3)"]


def test_the_nearest_reference_is_in_the_candidates_folder_not_a_folder_that_starts_like_it():
    runs = [RunInfo(path="runs/ab/ref", role="reference", precision="fp32", model=MODEL),
            RunInfo(path="runs/ref", role="reference", precision="fp32", model=MODEL),
            RunInfo(path="runs/a/cand", role="candidate", precision="fp32", model=MODEL)]
    # runs/ab/ is not inside runs/a/, so it has no claim over the shorter runs/ref
    assert matching_reference(runs, runs[2]).path == "runs/ref"
    runs.append(RunInfo(path="runs/a/deeper/ref", role="reference", precision="fp32", model=MODEL))
    assert matching_reference(runs, runs[2]).path == "runs/a/deeper/ref"
