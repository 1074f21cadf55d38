"""transformers' Llama as the independent reference of megatron-core's (docs/porting.md), end to end on CPU ranks:
a correct port passes at TP1 and TP2 + SP in fp32; a model bug fails at its module against HF and is localized
there, while the same code on one rank passes it; what the map gives no counterpart is listed, never skipped."""

import json
import re
from pathlib import Path

import pytest

from tests.conftest import load_comparison, run_ttrace
from ttrace_core.integrations.shipped_maps import MAPS_DIR

pytestmark = pytest.mark.distributed

MAP = "hf-llama--megatron-gpt"
SIZE = ("--num-layers", "1", "--micro-batches", "1", "--num-query-groups", "2")
TP2_SP = ("--tp", "2", "--sp")


def record(out: Path, workload: str, *flags: str) -> Path:
    if not (out / "manifest.json").exists():
        run_ttrace("example", workload, *SIZE, *flags, "--out", str(out), timeout=600, check_codes=(0,))
    return out


@pytest.fixture(scope="module")
def hf(traces) -> Path:
    return record(traces / "porting-hf", "hf-llama")


@pytest.fixture(scope="module")
def port(traces) -> Path:
    return record(traces / "porting-tp1", "megatron-gpt", "--llama")


def compare(reference: Path, candidate: Path, *flags: str, codes=(0, 1)):
    report = candidate.parent / f"{candidate.name}-vs-{reference.name}-{len(flags)}.json"
    result = run_ttrace("compare", str(reference), str(candidate), "--json", str(report), *flags, check_codes=codes)
    return result, load_comparison(report)


@pytest.mark.parametrize("layout", ["tp1", "tp2-sp"])
def test_a_correct_port_passes_against_hf(hf, port, traces, layout):
    candidate = port if layout == "tp1" else record(traces / "porting-tp2-sp", "megatron-gpt", "--llama", *TP2_SP)
    result, comparison = compare(hf, candidate, "--map", MAP, codes=(0,))
    assert comparison.verdict == "equivalent"
    assert {c.key.phase for c in comparison.comparisons} == {"forward", "backward", "grad", "step", "param"}
    fqns = {c.key.fqn for c in comparison.comparisons}
    assert {"decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.mlp.linear_fc1.weight", "output_layer"} <= fqns
    coverage = comparison.coverage
    assert coverage.unmapped > 0 and coverage.num_unaccounted == 0
    assert any("rotary angles" in line for line in coverage.unmapped_reasons)
    assert "unmapped: map hf-llama--megatron-gpt: candidate:" in result.stdout


def test_a_model_bug_fails_at_its_module_against_hf_and_passes_the_same_code(hf, traces):
    same_code = record(traces / "porting-bug-tp1", "megatron-gpt", "--llama", "--bug", "proj-transposed")
    candidate = record(traces / "porting-bug-tp2-sp", "megatron-gpt", "--llama", "--bug", "proj-transposed", *TP2_SP)
    _, against_hf = compare(hf, candidate, "--map", MAP, codes=(1,))
    first = against_hf.first_divergence
    assert (first.key.phase, first.key.fqn, first.key.slot) == ("forward", "decoder.layers.0.self_attention.linear_proj", "output.0")
    assert first.status == "mismatch" and first.ratio > 100
    _, against_itself = compare(same_code, candidate, codes=(0,))
    assert against_itself.verdict == "equivalent"
    report = traces / "porting-localize.json"
    run_ttrace("localize", str(hf), str(same_code), "--map", MAP, "--json", str(report), timeout=600, check_codes=(1,))
    assert json.loads(report.read_text())["culprits"] == ["decoder.layers.0.self_attention.linear_proj"]


def test_a_tensor_the_map_does_not_relate_is_listed_in_coverage(hf, port, tmp_path):
    text = (MAPS_DIR / f"{MAP}.toml").read_text()
    rule = re.search(r'\[\[tensors\]\]\ncandidate = "decoder.final_layernorm"\n.*?\n\n', text, re.DOTALL).group(0)
    (tmp_path / "without-final-norm.toml").write_text(text.replace(rule, ""))
    _, comparison = compare(hf, port, "--map", str(tmp_path / "without-final-norm.toml"), codes=(1,))
    extras = {c.key.fqn for c in comparison.comparisons if c.status == "extra"}
    assert extras == {"decoder.final_layernorm"}
    assert comparison.coverage.num_unaccounted > 0
    assert any(line.startswith("reference: ") and "/model.norm/" in line for line in comparison.coverage.unaccounted)
    assert any(f.startswith("unmapped:") for f in comparison.findings)


def test_a_bad_map_is_refused_in_one_line(hf, port, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text((MAPS_DIR / f"{MAP}.toml").read_text().replace('groups = "groups"}]', 'groups = "kv_groups"}]', 1))
    result = run_ttrace("compare", str(hf), str(port), "--map", str(bad), check_codes=(2,))
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"ttrace: error: {bad}: $.parameters[1].transform: names fact 'kv_groups'")


LLAMA_FIELDS = ("model.num_layers=1 num_micro_batches=1 model.num_query_groups=2 model.swiglu=true "
                "model.normalization=RMSNorm model.position_embedding=rope model.add_bias_linear=false")


def test_ttrace_check_gates_megatron_layouts_against_hf_through_the_map(tmp_path):
    """`ttrace check` with `map` and the reference's own command: HF recorded and estimated once, mapped, and
    every megatron layout judged against it; the model bug, which the same code on one rank cannot see, fails."""
    config = tmp_path / "hf-llama.toml"
    config.write_text(f'''
command = "python -m ttrace_examples megatron-gpt {LLAMA_FIELDS} {{layout}}"
map = "{MAP}"
output = "out"
code = []
estimate_samples = 2
localize = false

[reference]
command = "python -m ttrace_examples hf-llama {LLAMA_FIELDS}"

[[candidate]]
name = "port"

[[candidate]]
name = "proj-transposed"
layout = "bug=proj-transposed"
''')
    done = run_ttrace("check", str(config), "--no-html", timeout=900, check_codes=(1,))
    check = json.loads((tmp_path / "out" / "check.json").read_text())
    outcomes = {layout["name"]: layout for layout in check["layouts"]}
    assert outcomes["port"]["outcome"] == "equivalent", done.stdout
    assert outcomes["proj-transposed"]["outcome"] == "not equivalent"
    assert outcomes["proj-transposed"]["first_divergence"] == "step 0 forward/decoder.layers.0.self_attention.linear_proj/output.0"
    mapped = Path(check["references"]["fp32"]["mapped"])
    assert mapped.parent.name == "mapped" and (mapped / "manifest.json").is_file()
    assert f"through {MAP}" in done.stdout


def test_a_correct_port_in_bf16_passes_against_hf_and_names_the_precision_choice(traces):
    """Both sides in bf16 (fp32 gradients and main weights on both), the HF reference estimated in bf16: the
    port passes at TP2 + SP, and the RMSNorm the two implementations compute at different precisions is named."""
    hf = record(traces / "porting-hf-bf16", "hf-llama", "--precision", "bf16")
    if not (hf / "tolerance_estimate.json").exists():
        run_ttrace("estimate", str(hf), "--samples", "2", timeout=600, check_codes=(0,))
    candidate = record(traces / "porting-tp2-sp-bf16", "megatron-gpt", "--llama", "--precision", "bf16", *TP2_SP)
    result, comparison = compare(hf, candidate, "--map", MAP, codes=(0,))
    assert comparison.verdict == "equivalent"
    assert comparison.coverage.num_unaccounted == 0
    (choice,) = [note for note in comparison.notes if note.startswith("precision-choice:")]
    assert "decoder.*layernorm computes in the input dtype" in choice and "model.*norm in float32" in choice
    assert "note: precision-choice:" in result.stdout
