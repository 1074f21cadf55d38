"""`ttrace localize` on the committed samples, through its jobs: every buggy sample's replay names
the zoo's ground-truth culprit, a clean one names none, a replay that does not run the candidate's
code is reported as not reproducing (exit 4), and a missing entrypoint is one line (exit 2)."""

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_ttrace
from ttrace_examples.megatron_gpt.bugs import CULPRITS, localized_correctly
from ttrace_core.localize.verdicts import Localization

pytestmark = pytest.mark.distributed

SAMPLES_DIR = Path(__file__).resolve().parents[1] / "sample_traces"
SAMPLES = json.loads((SAMPLES_DIR / "samples.json").read_text())
BUGGY = [s for s in SAMPLES if s.get("bug")]


@pytest.fixture(scope="module")
def samples(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("samples")
    shutil.copytree(SAMPLES_DIR, root, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".ttrace"))
    return root


def _localize(samples: Path, reference: str, candidate: str, *extra: str):
    out = samples / f"{candidate.replace('/', '-')}.loc.json"
    result = run_ttrace("localize", str(samples / reference), str(samples / candidate), "--json", str(out), *extra,
                        timeout=600)
    return result, (Localization.from_json(out.read_text()) if out.exists() else None)


@pytest.mark.parametrize("sample", BUGGY, ids=[s["name"] for s in BUGGY])
def test_the_replay_names_the_ground_truth_culprit(samples, sample):
    result, localization = _localize(samples, sample["reference"], sample["name"])
    assert result.returncode == 1, result.stdout + result.stderr
    assert localization.reproduced is True
    assert localized_correctly(sample["bug"], localization), (CULPRITS[sample["bug"]], localization.culprits)


def test_asking_again_answers_from_the_finished_job(samples):
    sample = BUGGY[0]
    first, _ = _localize(samples, sample["reference"], sample["name"])
    again, localization = _localize(samples, sample["reference"], sample["name"])
    assert "(cached replay:" in again.stdout and again.returncode == first.returncode == 1
    assert localization.culprits


def test_a_clean_sample_names_no_culprit(samples):
    clean = next(s for s in SAMPLES if s["reference"] and not s.get("bug"))
    result, localization = _localize(samples, clean["reference"], clean["name"])
    assert result.returncode == 0 and not localization.diverged and not localization.culprits


def _edited_copy(samples: Path, name: str, edit, label: str) -> str:
    copy = samples / f"{name.replace('/', '-')}-{label}"
    shutil.copytree(samples / name, copy, ignore=shutil.ignore_patterns(".ttrace"))
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy.name


def _edit_config(manifest: dict, **fields) -> None:
    """Change the example's config in the recorded command (`python -m ttrace_examples WORKLOAD --config JSON`)."""
    command = manifest["entrypoint"]["command"]
    at = command.index("--config") + 1
    command[at] = json.dumps({**json.loads(command[at]), **fields})


def test_a_replay_without_the_candidates_patch_is_not_reproducing(samples):
    sample = next(s for s in BUGGY if s["bug"] == "row-parallel-bias-per-rank")
    candidate = _edited_copy(samples, sample["name"], lambda m: _edit_config(m, bug=None), "without-patch")
    result, localization = _localize(samples, sample["reference"], candidate)
    assert result.returncode == 4, result.stdout + result.stderr
    assert "NOT REPRODUCED" in result.stdout and "linear_proj / output.0" in result.stdout
    assert localization.reproduced is False and not localization.culprits


def test_a_missing_entrypoint_says_which_and_what_to_do(samples):
    sample = BUGGY[0]
    candidate = _edited_copy(samples, sample["name"], lambda m: m["entrypoint"].update(command=["no_such_program"]),
                             "no-entrypoint")
    result, _ = _localize(samples, sample["reference"], candidate)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "cannot start 'no_such_program'" in line and "check the command" in line


def test_a_layer_is_replayed_alone_and_still_names_the_culprit(samples):
    sample = next(s for s in BUGGY if s["bug"] == "row-parallel-bias-per-rank")
    result, localization = _localize(samples, sample["reference"], sample["name"], "--module", "decoder.layers.0")
    assert result.returncode == 1, result.stdout + result.stderr
    assert localization.replay_scope == "module alone" and "only the module ran" in result.stdout
    assert localization.culprits[0] == sample["culprit"] and localization.reproduced is True
    assert all(m.fqn.startswith("decoder.layers.0") for m in localization.modules)
