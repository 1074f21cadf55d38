"""End to end through the `ttrace` CLI: record real distributed runs on CPU ranks, then compare.

Every candidate runs 2 spawned gloo ranks and 2 steps, against the single-rank reference.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, load_comparison, run_ttrace
from ttrace_core.format.reader import step_file_name

pytestmark = pytest.mark.distributed

CLEAN_LAYOUTS = {"tp2": ["--tp", "2"], "tp2-sp": ["--tp", "2", "--sp"], "fsdp2": ["--fsdp", "2"],
                 "ddp2": ["--dp", "2"], "pp2": ["--pp", "2"], "cp2": ["--cp", "2"]}


def _record(traces: Path, name: str, *flags: str, steps: int = 2) -> Path:
    out = traces / name
    if not (out / "manifest.json").exists():
        run_ttrace("example", "torch-gpt", *flags, "--steps", str(steps), "--out", str(out), check_codes=(0,))
    return out


@pytest.mark.parametrize("name", list(CLEAN_LAYOUTS), ids=list(CLEAN_LAYOUTS))
def test_clean_layout_matches_the_reference(traces, reference_run, name):
    candidate = _record(traces, name, *CLEAN_LAYOUTS[name])
    report = traces / f"{name}.json"
    result = run_ttrace("compare", str(reference_run), str(candidate), "--json", str(report))
    assert result.returncode == 0, result.stdout + result.stderr
    comparison = load_comparison(report)
    assert comparison.steps_compared == [0, 1]
    phases = {c.key.phase for c in comparison.comparisons}
    assert phases == {"forward", "backward", "grad", "step", "param"}
    assert all(comparison.comparisons) and len(comparison.comparisons) > 1500
    assert "PASSED (equivalent) |" in result.stdout


def test_parallel_runs_really_hold_shards(traces):
    """A clean verdict means something only if the candidate's tensors were sharded and mapped back."""
    from ttrace_core.format.reader import RunReader

    expected = {"tp2-sp": ("layers.0.ln1", "input.0", ("S(1)",)), "tp2": ("layers.0.attn.wq", "output.0", ("S(-1)",)),
                "fsdp2": ("layers.0.attn.wq.weight", "value", ("S(0)",)), "cp2": ("layers.0.ln1", "input.0", ("S(1)",))}
    for name, (fqn, slot, placements) in expected.items():
        with RunReader(_record(traces, name, *CLEAN_LAYOUTS[name])) as reader:
            metas = next(ms for key, ms in reader.index.items() if key.fqn == fqn and key.slot == slot)
            assert len(metas) == 2 and metas[0].layout.placements == placements, name
            assert metas[0].local_shape != metas[0].layout.global_shape


@pytest.mark.parametrize(
    "flags, culprit, phase",
    [(["--tp", "2", "--bug", "rowwise-skip-allreduce"], "layers.0.attn.wo", "forward"),
     (["--tp", "2", "--sp", "--bug", "rowwise-skip-allreduce"], "layers.0.attn.wo", "forward"),
     (["--dp", "2", "--bug", "ddp-unreduced-grad"], "layers.0.mlp.w2.bias", "grad"),
     (["--cp", "2", "--bug", "cp-attn-backward"], "layers.3.attn.wv", "backward")],
    ids=["tp2-rowwise-no-allreduce", "tp2-sp-rowwise-no-reduce-scatter", "ddp2-grad-never-reduced", "cp2-attn-backward"],
)
def test_broken_candidate_is_caught_at_the_broken_module(traces, reference_run, flags, culprit, phase):
    name = "-".join(f.strip("-") for f in flags)
    candidate = _record(traces, name, *flags, steps=1)
    report = traces / f"{name}.json"
    result = run_ttrace("compare", str(reference_run), str(candidate), "--json", str(report))
    assert result.returncode == 1, result.stdout + result.stderr
    first = load_comparison(report).first_divergence
    assert (first.key.fqn, first.key.phase, first.key.step) == (culprit, phase, 0)
    assert first.ratio > 100
    assert f"first divergence (execution order):" in result.stdout and culprit in result.stdout.split("\n")[5]


@pytest.mark.parametrize("flags, culprit", [(["--tp", "2", "--bug", "rowwise-skip-allreduce"], "layers.0.attn.wo"),
                                            (["--dp", "2", "--bug", "ddp-unreduced-grad"], "layers.0.mlp.w2.bias")],
                         ids=["tp2-rowwise", "ddp2-unreduced"])
def test_localize_names_the_culprit_of_torch_gpts_own_bugs(traces, reference_run, flags, culprit):
    """The replay reproduces a candidate whose replicas disagree (the unreduced gradient, the partial sums
    left unreduced) rather than refusing it as 'not reproduced'."""
    candidate = _record(traces, "-".join(f.strip("-") for f in flags), *flags, steps=1)
    result = run_ttrace("localize", str(reference_run), str(candidate))
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"culprit: {culprit}" in result.stdout


def test_recording_killed_mid_step_keeps_its_completed_steps(traces, reference_run):
    out = traces / "killed"
    script = ROOT / "tests" / "scripts" / "record_and_die.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    died = subprocess.run([sys.executable, str(script), str(out)], env=env, timeout=120, capture_output=True, text=True)
    assert died.returncode == -signal.SIGKILL, died.stderr
    assert (out / (step_file_name(0, 1) + ".partial")).exists()
    inspect = run_ttrace("inspect", str(out), check_codes=(0,))
    assert "complete steps: [0]" in inspect.stdout and "partial step 1" in inspect.stdout
    # the finished step passes, but a verdict on step 0 alone is partial: exit 1 unless asked for
    result = run_ttrace("compare", str(reference_run), str(out))
    assert result.returncode == 1 and "finding: incomplete: steps [1] were not compared" in result.stdout, result.stdout
    result = run_ttrace("compare", str(reference_run), str(out), "--partial", "--json", str(traces / "killed.json"))
    assert result.returncode == 0, result.stdout + result.stderr
    comparison = load_comparison(traces / "killed.json")
    assert comparison.steps_compared == [0] and all(comparison.comparisons) and comparison.verdict == "partial"
    assert any("candidate step 1 is partial" in note for note in comparison.notes)


def test_truncated_file_gives_exit_2_naming_it(traces, reference_run):
    copy = traces / "truncated"
    subprocess.run(["cp", "-r", str(_record(traces, "tp2", *CLEAN_LAYOUTS["tp2"])), str(copy)], check=True)
    victim = copy / step_file_name(1, 0)
    os.truncate(victim, 4096)
    result = run_ttrace("compare", str(reference_run), str(copy))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert str(victim) in line and "truncated or corrupted" in line


def test_missing_rank_file_gives_exit_2(traces, reference_run):
    copy = traces / "missing-rank"
    subprocess.run(["cp", "-r", str(_record(traces, "ddp2", *CLEAN_LAYOUTS["ddp2"])), str(copy)], check=True)
    for step in (0, 1):
        (copy / step_file_name(1, step)).unlink()
    result = run_ttrace("compare", str(reference_run), str(copy))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "no file of rank 1" in line and str(copy) in line


def test_mismatched_model_configuration_gives_exit_2(traces, reference_run):
    other = _record(traces, "two-layers", "--num-layers", "2", steps=1)
    result = run_ttrace("compare", str(reference_run), str(other))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "model configuration differs" in line and "num_layers: 4 vs 2" in line


def test_not_a_run_directory_gives_exit_2(tmp_path, reference_run):
    result = run_ttrace("compare", str(reference_run), str(tmp_path))
    assert result.returncode == 2 and "manifest.json: missing" in result.stderr


def test_estimate_and_localize_refuse_a_stats_only_reference(traces, reference_run):
    stats_only = _record(traces, "stats-only-reference", "--stats-only", steps=1)
    for command in (["estimate", str(stats_only)], ["localize", str(stats_only), str(reference_run)]):
        result = run_ttrace(*command)
        (line,) = result.stderr.strip().splitlines()
        assert result.returncode == 2 and "stats-only" in line and str(stats_only) in line, command


def test_unsupported_layout_is_refused_before_spawning(tmp_path):
    result = run_ttrace("example", "torch-gpt", "--sp", "--out", str(tmp_path / "x"))
    assert result.returncode == 2 and "--sp needs --tp 2 or more" in result.stderr


def test_the_example_records_under_torchrun_like_any_script(traces, reference_run):
    out = traces / "torchrun-tp2"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "ttrace_examples", "torch-gpt", "--config", '{"tp": 2}']
    run_ttrace("record", "--out", str(out), "--", *torchrun, check_codes=(0,))
    result = run_ttrace("compare", str(reference_run), str(out))
    assert result.returncode == 0, result.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["entrypoint"]["command"] == torchrun


def test_ttrace_example_under_torchrun_says_how_to_record_it(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                           "-m", "ttrace_core", "example", "torch-gpt", "--out", str(tmp_path / "x")],
                          env=env, timeout=120, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode != 0 and "ttrace record --out" in done.stderr and not (tmp_path / "x").exists()


def test_inspect_and_progress_bar(traces, reference_run, tmp_path):
    import shutil

    listing = run_ttrace("inspect", str(reference_run), "--tensors", check_codes=(0,)).stdout
    assert "role: reference  world_size: 1" in listing and "layers.3.mlp.w2 / output.0" in listing
    same = shutil.copytree(reference_run, tmp_path / "same", ignore=shutil.ignore_patterns(".ttrace", ".localize"))
    result = run_ttrace("compare", str(reference_run), str(same), "--progress", check_codes=(0,))  # not itself: refused
    assert "comparing [" in result.stderr and "PASSED (equivalent) |" in result.stdout


def test_every_command_has_a_description_help_for_its_positionals_and_its_defaults_shown():
    """Issue 41: subcommands had no paragraph, positionals no help, defaults were not shown, `ttrace bugs --help`
    was empty."""
    import argparse

    from ttrace_core.cli.main import _build_parser

    parser = _build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in commands.choices.items():
        assert command.description, f"ttrace {name} --help has no description"
        for action in command._actions:
            if not action.option_strings and action.help != argparse.SUPPRESS:
                assert action.help, f"ttrace {name}: positional {action.dest} has no help"
    helps = {name: " ".join(command.format_help().split()) for name, command in commands.choices.items()}
    assert "(default: 10)" in helps["compare"] and "default: 4)" in helps["estimate"]
    assert "first free one from 8501" in helps["dashboard"]
    assert "Takes no arguments" in helps["bugs"]
