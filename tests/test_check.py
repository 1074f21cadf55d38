"""`ttrace check`: a TOML config of layouts recorded, compared and localized as a CI gate, with JUnit,
Markdown and JSON outputs (service/check.py, service/check_outputs.py, cli/check.py)."""

import json
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.cli_support import ttrace_command
from ttrace_core.service.check_config import CheckConfig, CheckConfigError, Layout, read_check_config

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[1]
SMALL = "model.num_layers=2 num_micro_batches=2"
TORCH_GPT = f"{sys.executable} -m ttrace_examples torch-gpt {SMALL} precision={{precision}} {{layout}}"
USER_SCRIPT = "torchrun --standalone --nproc-per-node {world_size} tests/user_script/train_traced.py {layout}"
"""A user's DTensor script (tests/test_user_script.py): its --bug is localized at blocks.0.attn."""


def _config(directory: Path, candidates: str, command: str = TORCH_GPT, code: str = "ttrace_examples/torch_gpt/*.py",
            extra: str = "") -> Path:
    path = directory / "check.toml"
    path.write_text(textwrap.dedent(f"""\
        command = {json.dumps(command)}
        output = "out"
        cwd = {json.dumps(str(ROOT))}
        code = [{json.dumps(code)}]
        estimate_samples = 2
        {extra}
        [reference]
        layout = ""
        """) + textwrap.dedent(candidates))
    return path


THREE_LAYOUTS = """
    [[candidate]]
    name = "tp2"
    layout = "--tp 2"
    world_size = 2
    [[candidate]]
    name = "dp2"
    layout = "--dp 2"
    world_size = 2
    [[candidate]]
    name = "tp2-bug"
    layout = "--tp 2 --bug"
    world_size = 2
    """


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    directory = tmp_path_factory.mktemp("check")
    config = _config(directory, THREE_LAYOUTS, command=USER_SCRIPT, code="tests/user_script/*.py")
    first = ttrace_command("check", str(config), cwd=directory, timeout=900)
    second = ttrace_command("check", str(config), cwd=directory, timeout=900)
    return directory / "out", first, second


def test_one_buggy_layout_fails_the_gate_and_is_localized(checked):
    out, first, _ = checked
    assert first.returncode == 1, first.stderr[-3000:]
    suite = ET.parse(out / "junit.xml").getroot().find("testsuite")
    cases = {case.get("name"): case for case in suite.iter("testcase")}
    assert sorted(cases) == ["dp2", "tp2", "tp2-bug"]
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("3", "1", "0")
    failure = cases["tp2-bug"].find("failure")
    assert failure is not None and cases["tp2"].find("failure") is None and cases["dp2"].find("failure") is None
    assert "culprit blocks.0.attn" in failure.get("message")
    assert "first divergence at step 0" in failure.get("message")
    summary = (out / "summary.md").read_text()
    assert len(summary.encode()) < 2**20 and "| tp2-bug | fp32 | ❌ not equivalent" in summary
    assert "| tp2 | fp32 | ✅ equivalent" in summary
    verdicts = json.loads((out / "check.json").read_text())
    assert verdicts["exit_code"] == 1 and [v["outcome"] for v in verdicts["layouts"]] == [
        "equivalent", "equivalent", "not equivalent"]
    assert Path(verdicts["layouts"][2]["report"]).is_file()


def test_a_second_run_reuses_every_recording(checked):
    out, first, second = checked
    assert second.returncode == 1, second.stderr[-3000:]
    verdicts = json.loads((out / "check.json").read_text())
    assert verdicts["references"]["fp32"]["reused"] is True
    assert all(layout["reused"] for layout in verdicts["layouts"])
    assert "reference reused" in second.stdout and "reference recorded" in first.stdout


def test_a_layout_whose_command_fails_is_an_error_and_the_others_still_run(tmp_path):
    config = _config(tmp_path, """
        [[candidate]]
        name = "tp3"
        layout = "tp=3"
        world_size = 3
        [[candidate]]
        name = "tp2"
        layout = "tp=2"
        world_size = 2
        """, extra="localize = false")
    done = ttrace_command("check", str(config), "--no-html", cwd=tmp_path, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    suite = ET.parse(tmp_path / "out" / "junit.xml").getroot().find("testsuite")
    cases = {case.get("name"): case for case in suite.iter("testcase")}
    error = cases["tp3"].find("error")
    assert error is not None and "exited with code" in error.get("message") and "tp3.log" in error.text
    assert cases["tp2"].find("failure") is None and cases["tp2"].find("error") is None
    assert "⚠️ error" in (tmp_path / "out" / "summary.md").read_text()


def test_a_reference_that_does_not_train_is_refused_with_one_line(tmp_path):
    script = ROOT / "tests" / "scripts" / "dead_reference.py"
    config = _config(tmp_path, '[[candidate]]\nname = "same"\n', command=f"{sys.executable} {script}",
                     code="tests/scripts/dead_reference.py")
    done = ttrace_command("check", str(config), cwd=tmp_path, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert "the reference did not train" in line and "gradients" in line and "zero" in line


@pytest.mark.parametrize("text, says", [
    ('command = ""\n[[candidate]]\nname = "a"\n', "command must name the command to record, e.g. command = "),
    ('[[candidate]]\nname = "a"\n', "command must name the command to record"),
    ('command = "x {layout}"\n', "no candidate layout; add at least one [[candidate]] table"),
    ('command = "x"\nprecisions = ["fp16"]\n[[candidate]]\nname = "a"\n',
     "precisions item 1: 'fp16' is no precision; choose from fp32, bf16, fp8"),
    ('command = "x"\n[[candidate]]\nname = "a"\nworld_size = 0\n', "[[candidate]] 1 ('a'): world_size is 0; give an integer >= 1"),
    ('command = "x"\n[[candidate]]\nname = "a"\n[[candidate]]\nname = "b"\nworld_size = "2"\n',
     """[[candidate]] 2 ('b'): world_size is "2"; give an integer"""),
    ('command = "x"\ntimeout = true\n[[candidate]]\nname = "a"\n', "timeout is true; give a number"),
    ('command = "x"\ncode = ["*.py", 3]\n[[candidate]]\nname = "a"\n', "code item 2 is 3; give a string"),
    ('command = "x"\n[[candidate]]\nname = "reference"\n', "layout name 'reference' repeats; give each layout its own name"),
    ('command = "x"\n[[candidate]]\nlayout = "--tp 2"\n', "[[candidate]] 1 has no name; give each layout a short name"),
    ('command = "x"\n[[candidate]]\nname = "a/b"\n', "[[candidate]] 1 ('a/b'): name 'a/b': give a non-empty name without '/'"),
    ('command = "x"\nlayouts = 1\n', "unknown key 'layouts'; known keys: command, candidate, reference, precisions"),
    ('command = "x"\nprecision = "bf16"\n[[candidate]]\nname = "a"\n',
     "unknown key 'precision'; did you mean 'precisions'? known keys: command, candidate"),
    ('command = "x"\n[[candidate]]\nname = "a"\nwold_size = 2\n',
     "unknown key 'wold_size' in [[candidate]] 1 ('a'); did you mean 'world_size'? known keys: name, layout, world_size"),
    ('command = "x"\n[reference]\nnmae = "r"\n[[candidate]]\nname = "a"\n', "unknown key 'nmae' in [reference]; did you mean 'name'?"),
    ('command = [1\n', "not valid TOML"),
    ('command = "x"\nmap = "hf-llama--megatron"\n[[candidate]]\nname = "a"\n',
     "map 'hf-llama--megatron' is neither a shipped map (hf-llama--megatron-gpt, "),
    ('command = "x"\nmap = 3\n[[candidate]]\nname = "a"\n', "map is 3; give a string"),
    ('command = "x"\n[reference]\ncommand = ""\n[[candidate]]\nname = "a"\n',
     "[reference]: command is empty; give this layout's command or leave the key out"),
], ids=["empty-command", "no-command", "no-candidate", "precision", "world-size-range", "world-size-type", "timeout-type",
        "code-item-type", "name-repeats", "no-name", "name-slash", "unknown-key", "typo-top-level", "typo-in-candidate",
        "typo-in-reference", "toml", "unknown-map", "map-type", "empty-layout-command"])
def test_a_bad_config_is_one_line_naming_the_file_the_key_and_what_to_give(tmp_path, text, says):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(CheckConfigError) as raised:
        read_check_config(path)
    assert str(raised.value).startswith(f"{path}: ") and says in str(raised.value) and "\n" not in str(raised.value)


def test_a_good_config_is_read_with_every_key(tmp_path):
    path = tmp_path / "good.toml"
    path.write_text('command = ["torchrun", "train.py", "{layout}"]\nprecisions = "bf16"\noutput = "out"\ncwd = "."\n'
                    'code = "*.py"\ntimeout = 60\nestimate_samples = 2\nlocalize = false\n'
                    '[reference]\nname = "single"\nlayout = ["--seed", "1"]\n'
                    '[[candidate]]\nname = "tp2"\nlayout = "--tp 2"\nworld_size = 2\n')
    config = read_check_config(path)
    assert config == CheckConfig(
        path=path, command=("torchrun", "train.py", "{layout}"), precisions=("bf16",), output=tmp_path / "out",
        cwd=tmp_path, code=("*.py",), timeout_s=60.0, estimate_samples=2, localize=False,
        reference=Layout(name="single", args=("--seed", "1")), candidates=(Layout(name="tp2", args=("--tp", "2"), world_size=2),))


def test_another_implementation_as_the_reference_has_its_own_command_and_a_map(tmp_path):
    """`[reference] command` and `map` (docs/porting.md): the reference runs its own command, the candidates the
    config's; a shipped map is kept by name, a map file is resolved against the config's folder."""
    from ttrace_core.integrations.shipped_maps import MAPS_DIR

    (tmp_path / "maps").mkdir()
    (tmp_path / "maps" / "mine.toml").write_text((MAPS_DIR / "hf-llama--megatron-gpt.toml").read_text())
    for written, expected in (("hf-llama--megatron-gpt", "hf-llama--megatron-gpt"),
                              ("maps/mine.toml", str(tmp_path / "maps" / "mine.toml"))):
        path = tmp_path / "c.toml"
        path.write_text(f'command = "python cand.py {{layout}}"\nmap = "{written}"\n[reference]\n'
                        'command = ["python", "hf.py", "--precision", "{precision}"]\n'
                        '[[candidate]]\nname = "tp2"\nlayout = "--tp 2"\nworld_size = 2\n')
        config = read_check_config(path)
        assert config.map == expected
        assert config.command_for(config.reference, "bf16") == ["python", "hf.py", "--precision", "bf16"]
        assert config.command_for(config.candidates[0], "bf16") == ["python", "cand.py", "--tp", "2"]


def test_a_minimal_config_takes_the_defaults(tmp_path):
    path = tmp_path / "minimal.toml"
    path.write_text('command = "python train.py {layout}"\n[[candidate]]\nname = "tp2"\n')
    config = read_check_config(path)
    assert (config.reference, config.precisions, config.output, config.cwd, config.code, config.timeout_s,
            config.estimate_samples, config.localize) == (Layout(name="reference"), ("fp32",), tmp_path / "ttrace-check",
                                                          tmp_path, (), 1800.0, 4, True)


def test_the_command_takes_each_layouts_arguments_world_size_and_precision(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('command = "torchrun --nproc-per-node {world_size} train.py --precision {precision} {layout}"\n'
                    '[[candidate]]\nname = "tp2-sp"\nlayout = "--tp 2 --sp"\nworld_size = 2\n')
    config = read_check_config(path)
    assert config.command_for(config.candidates[0], "bf16") == [
        "torchrun", "--nproc-per-node", "2", "train.py", "--precision", "bf16", "--tp", "2", "--sp"]
    assert config.command_for(config.reference, "fp32") == [
        "torchrun", "--nproc-per-node", "1", "train.py", "--precision", "fp32"]


@pytest.mark.parametrize("name, workloads", [
    ("torch-gpt", ("torch-gpt", "torch-gpt")), ("megatron-gpt", ("megatron-gpt", "megatron-gpt")),
    ("hf-llama", ("hf-llama", "megatron-gpt")),
], ids=["torch-gpt", "megatron-gpt", "hf-llama"])
def test_the_example_configs_name_valid_layouts_of_their_example(name, workloads):
    """Every layout and precision of the shipped configs is a config the example accepts (no recording); the
    hf-llama config's reference is HF's model, which takes the candidate's config (check_reference_config)."""
    from ttrace_examples.__main__ import _with_fields
    from ttrace_examples.launch import run_config

    config = read_check_config(ROOT / "ttrace_examples" / "configs" / f"{name}.toml")
    assert config.cwd == ROOT and config.output == ROOT / "ttrace-check" / name
    for layout, workload in ((config.reference, workloads[0]), *((c, workloads[1]) for c in config.candidates)):
        for precision in config.precisions:
            command = config.command_for(layout, precision)
            assert command[:4] == ["python", "-m", "ttrace_examples", workload]
            run = run_config(workload, _with_fields({}, command[4:]))
            assert run.world_size == layout.world_size and run.precision == precision
    if name == "hf-llama":
        from ttrace_examples.hf_llama.train import check_reference_config

        assert config.map == "hf-llama--megatron-gpt"
        check_reference_config(run_config("megatron-gpt", _with_fields({}, config.command_for(config.reference, "fp32")[4:])))


def test_the_user_script_config_runs_torchrun_with_each_layouts_world_size():
    config = read_check_config(ROOT / "ttrace_examples" / "configs" / "user-script.toml")
    two_d = next(c for c in config.candidates if c.name == "tp2-fsdp2")
    assert config.command_for(two_d, "fp32") == ["torchrun", "--standalone", "--nproc-per-node", "4",
                                                  "tests/user_script/train_traced.py", "--tp", "2", "--dp", "2", "--checkpoint"]
    assert (config.cwd / "tests/user_script/train_traced.py").is_file()


def test_the_check_docs_figures_are_the_results_files():
    import re

    results = (ROOT / "benchmarks" / "results" / "check.md").read_text()
    readme = (ROOT / "docs" / "check.md").read_text()
    first = re.search(r"- first run: (\d+) s in all", results).group(1)
    second, reused = re.search(r"- second run, nothing changed: (\d+) s, exit code \d+; (\d+) of \d+ candidate", results).groups()
    assert f"took {first} s on 2 shared cores" in readme and f"and {second} s the second time, when all {reused} candidate" in readme
    table = [line for line in results.split("## The Markdown summary of the first run")[1].splitlines() if line.startswith("| ")]
    assert table and all(line in readme for line in table)
