"""Adaptive capture (adaptive.py): statistics for every step, values for the window only, and the same
first divergence as a full capture of a zoo bug."""

from __future__ import annotations

import json
import warnings

import pytest

from tests.conftest import MEGATRON_SIZE, load_comparison, run_ttrace
from ttrace_core.workflows.adaptive import _record_values, value_window
from ttrace_core.errors import TtraceError
from ttrace_core.format.reader import RunReader, read_manifest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("megatron.core")

FLAGS = ("megatron-gpt", *MEGATRON_SIZE, "--hidden-size", "16", "--steps", "2")
BUG = ("--tp", "2", "--bug", "row-parallel-bias-per-rank")


def test_the_window_is_the_first_step_and_the_first_diverging_one():
    assert value_window(None, [0, 1, 2]) == [0]  # no statistic diverges: a norm-keeping bug still shows in step 0
    assert value_window(0, [0, 1, 2]) == [0]
    assert value_window(2, [0, 1, 2]) == [0, 2]


def test_a_values_pass_that_records_nothing_keeps_the_stats_trace(tmp_path):
    from tests.synthetic_runs import write_run

    run = write_run(tmp_path / "cand", role="candidate", world_size=2)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(TtraceError, match="left no complete rank_00000.step_000000.h5; the stats-only trace"):
        _record_values(run, [0], lambda *args, **kwargs: None, timeout_s=10)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


@pytest.mark.slow
def test_adaptive_capture_finds_the_first_divergence_full_capture_finds(tmp_path):
    reference, full, adaptive = tmp_path / "reference", tmp_path / "full", tmp_path / "adaptive"
    run_ttrace("example", *FLAGS, "--out", str(reference), check_codes=(0,))
    run_ttrace("example", *FLAGS, *BUG, "--out", str(full), check_codes=(0,))
    done = run_ttrace("example", *FLAGS, *BUG, "--adaptive", str(reference), "--out", str(adaptive), check_codes=(0,))
    assert "statistics for steps [0, 1], values for steps [0]" in done.stdout
    assert read_manifest(adaptive).tracer["value_steps"] == [0]
    with RunReader(adaptive) as reader:  # values where the window is, statistics elsewhere
        assert {m.stats_only for k, metas in reader.index.items() if k.step == 0 for m in metas} == {False}
        assert {m.stats_only for k, metas in reader.index.items() if k.step == 1 for m in metas} == {True}
    for name, run in (("full", full), ("adaptive", adaptive)):
        run_ttrace("compare", str(reference), str(run), "--json", str(tmp_path / f"{name}.json"), check_codes=(1,))
    by_full = load_comparison(tmp_path / "full.json").first_divergence
    by_adaptive = load_comparison(tmp_path / "adaptive.json").first_divergence
    assert by_adaptive.key == by_full.key and by_adaptive.status == by_full.status == "mismatch"
    assert not by_adaptive.stats_only and by_adaptive.ratio == pytest.approx(by_full.ratio, rel=1e-9)
    size = lambda run: sum(p.stat().st_size for p in run.glob("*.h5"))  # noqa: E731
    assert size(adaptive) < 0.7 * size(full)

    # localize relaunches the stats-only command: its replay still records the judged step's values
    done = run_ttrace("localize", str(reference), str(adaptive), "--json", str(tmp_path / "localize.json"), check_codes=(1,))
    assert "culprit: decoder.layers.0.self_attention.linear_proj" in done.stdout
    with RunReader(json.loads((tmp_path / "localize.json").read_text())["replay"]) as reader:
        assert reader.complete_steps == [0] and not any(m.stats_only for ms in reader.index.values() for m in ms)
