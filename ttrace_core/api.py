"""The one facade over the stages, for the CLI and the dashboard alike.

- `find_runs(root)`: every run directory under a root, from its manifest and file names only;
- `comparison_table(ref, cand, settings)`: the comparison table (compare/table.py), computed once and
  cached as Parquet under the candidate until one of its inputs changes (service/comparisons.py);
  `run_comparison` is the same as a `RunComparison`, which the CLI renders; `verdict_of` reads the
  verdict back from a table's provenance (with its headroom by tensor kind, which sums up the rows'
  `detectable` column);
- `tensor_view(ref, cand, tensor, step, micro_batch)`: one tensor's canonical arrays, their
  difference and the per-rank shard map, read from the few datasets that hold it;
- `submit_comparison(ref, cand, settings)`: a large pair's first comparison as a job that streams its
  rows (service/comparison_jobs.py); `streamed_rows(job)` reads the rows so far, in execution order,
  with the first divergence as soon as it is known; `cached_comparison_table` answers once it is done;
  `comparison_lookup` asks the cache once and hands its answer to either, so a page load fingerprints each
  run once;
- `submit_replay(ref, cand, module, settings=...)`: a localization replay as a job (service/jobs.py),
  cached by its inputs; `localization(job)` reads its verdict;
- `path_under_root(root, relative)`: a user-given path confined to the root (the dashboard serves
  only files under it);
- for the CLI's other commands: `record` (and `record_adaptively`), `estimate`, `localize_here` (the
  replay a localize job runs), `compare_in_workers` and `compare_as_rank`, `read_check_config`,
  `run_check` and `check_outputs`, `open_run` and `read_manifest` (inspect), `serve_dashboard`.

Pages and the CLI (ttrace_core/cli) call these, never the stages directly: the terminal and the browser
cannot disagree, and tests/core/test_import_layers.py holds both to it. Importing this module loads no
torch: the stages behind each call are imported when it is made (the imports inside the functions below).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from ttrace_core.compare.results import ComparisonStatus, KindHeadroom, RunComparison, TensorComparison, VerdictSummary
from ttrace_core.compare.settings import MIN_MAX_MEMORY, TOLERANCE_KINDS, CompareSettings
from ttrace_core.errors import TraceFormatError, TtraceError, TtraceInternalError
from ttrace_core.format.naming import KINDS, PSEUDO_MODULES, display_fqn, is_descendant, layer_module, owner_of, tensor_id
from ttrace_core.format.schema import PRE_STEP_SLOT
from ttrace_core.service.jobs import Job
from ttrace_core.service.dashboard import ROOT_ENV
from ttrace_core.service.runs import RunInfo, find_runs, pair_problem, path_under_root, run_info

if TYPE_CHECKING:
    from ttrace_core.compare.estimate_file import PerturbationEstimate
    from ttrace_core.format.reader import RunReader
    from ttrace_core.canonicalize.correspondence import LoadedMap
    from ttrace_core.format.schema import Finding, RunManifest
    from ttrace_core.localize.verdicts import Localization
    from ttrace_core.service.check import CheckResult
    from ttrace_core.service.check_config import CheckConfig
    from ttrace_core.service.comparison_jobs import StreamedRows
    from ttrace_core.service.comparisons import CacheLookup, ComparisonTable
    from ttrace_core.service.tensor_view import TensorView
    from ttrace_core.workflows.adaptive import AdaptiveCapture

__all__ = ["KINDS", "LOCALIZE_EXIT_CODES", "MIN_MAX_MEMORY", "PRE_STEP_SLOT", "PSEUDO_MODULES", "ROOT_ENV", "TOLERANCE_KINDS",
           "CompareSettings", "ComparisonStatus", "Job", "KindHeadroom", "RunComparison", "RunInfo", "TensorComparison", "TraceFormatError",
           "TtraceError", "TtraceInternalError", "VerdictSummary",
           "cached_comparison_table", "check_outputs", "compare_as_rank", "display_fqn", "compare_in_workers", "comparison",
           "comparison_lookup", "comparison_streams", "comparison_table", "correspondence_map", "estimate", "finding_lines",
           "fitting_maps", "shipped_map_names",
           "localize_here", "open_run", "read_check_config", "read_manifest", "record", "record_adaptively", "run_check",
           "serve_dashboard",
           "find_runs", "is_descendant", "layer_module", "localization", "mapped_reference", "owner_of", "pair_problem",
           "path_under_root",
           "replay_job", "replay_job_dir", "run_comparison", "run_info", "streamed_comparison", "streamed_rows",
           "submit_comparison", "submit_replay", "tensor_id", "tensor_view", "ttrace_version", "verdict_of"]

LOCALIZE_EXIT_CODES = (0, 1, 4)
"""`ttrace localize` exit codes that carry a verdict: none, culprit named, diverged but not explained."""


def mapped_reference(reference: str | os.PathLike, map_name: str | os.PathLike,
                     progress: Callable[[str], None] | None = None) -> Path:
    """A reference of another implementation rewritten in the candidate's names and layouts through a
    correspondence map (workflows/mapped_reference.py): the directory compare and localize take as the reference."""
    from ttrace_core.workflows.mapped_reference import mapped_reference as mapped

    return mapped(reference, map_name, progress=progress)


def shipped_map_names() -> list[str]:
    """The correspondence maps ttrace ships, by the name `--map` takes (integrations/maps/*.toml)."""
    from ttrace_core.integrations.shipped_maps import shipped_map_names as names

    return names()


def correspondence_map(name_or_path: str | os.PathLike) -> LoadedMap:
    """A shipped map by name or a map file, decoded and checked (`.spec.reference`, `.spec.candidate` say what it
    relates, in words); MapError in one line naming the file, the key and what is wrong."""
    from ttrace_core.integrations.shipped_maps import find_map

    return find_map(name_or_path)


def fitting_maps(reference_model: dict, candidate_model: dict) -> list[str]:
    """The shipped maps that relate a reference of another implementation to a candidate, judged from the model
    facts their manifests record (`RunInfo.model`): the map's facts resolve in the reference's transformers config,
    and its rules turn the reference's parameters into the candidate's (integrations/shipped_maps.map_fits)."""
    from ttrace_core.integrations.shipped_maps import fitting_maps as fitting

    return fitting(reference_model, candidate_model)


def ttrace_version() -> str:
    from ttrace_core.service.comparisons import ttrace_version as version

    return version()


def comparison_table(reference: str | os.PathLike, candidate: str | os.PathLike, settings: CompareSettings | None = None,
                     *, progress: Callable[[int, int], None] | None = None, rebuild: bool = False,
                     lookup: CacheLookup | None = None) -> ComparisonTable:
    """The comparison of two runs as a table (frame, provenance, path, cached), from the cache when its inputs are
    unchanged; `lookup`: the answer of `comparison_lookup` for these runs and settings, not asked again."""
    from ttrace_core.service.comparisons import comparison_table as table_of

    return table_of(reference, candidate, settings, progress=progress, rebuild=rebuild, lookup=lookup)


def comparison(reference: str | os.PathLike, candidate: str | os.PathLike, settings: CompareSettings | None = None,
               **kwargs) -> pd.DataFrame:
    """The comparison table as a DataFrame; `frame.attrs["ttrace"]` holds its provenance."""
    result = comparison_table(reference, candidate, settings, **kwargs)
    result.frame.attrs["ttrace"] = result.provenance
    return result.frame


def run_comparison(reference: str | os.PathLike, candidate: str | os.PathLike, settings: CompareSettings | None = None,
                   **kwargs) -> RunComparison:
    """The same comparison as a `RunComparison` (what `ttrace compare` prints and writes as JSON)."""
    from ttrace_core.compare.table import comparison_from_table

    result = comparison_table(reference, candidate, settings, **kwargs)
    return comparison_from_table(result.frame, result.provenance)


def comparison_lookup(reference: str | os.PathLike, candidate: str | os.PathLike,
                      settings: CompareSettings | None = None) -> CacheLookup:
    """Whether the comparison was computed with these inputs before (`.table`, else None), asked once: a page hands
    the answer to `comparison_table` or `submit_comparison`, which then neither fingerprint nor read a manifest again."""
    from ttrace_core.service.comparisons import lookup_table

    return lookup_table(reference, candidate, settings)


def cached_comparison_table(reference: str | os.PathLike, candidate: str | os.PathLike,
                            settings: CompareSettings | None = None) -> ComparisonTable | None:
    """The comparison table if it was computed with these inputs before, else None (nothing is compared)."""
    from ttrace_core.service.comparisons import cached_table

    return cached_table(reference, candidate, settings)


def comparison_streams(reference: str | os.PathLike, candidate: str | os.PathLike) -> bool:
    """Whether the first comparison of this pair is a streamed job (large pairs) rather than a call."""
    from ttrace_core.service.comparison_jobs import streams

    return streams(Path(reference), Path(candidate))


def submit_comparison(reference: str | os.PathLike, candidate: str | os.PathLike,
                      settings: CompareSettings | None = None, *, lookup: CacheLookup | None = None) -> Job:
    """Start (or find) the streamed comparison job of a pair; `streamed_rows(job)` reads what it has compared.
    `lookup`: the answer of `comparison_lookup` for these runs and settings, not asked again."""
    from ttrace_core.service.comparison_jobs import submit_comparison as submit

    return submit(reference, candidate, settings, lookup=lookup)


def streamed_rows(job: Job, known: StreamedRows | None = None) -> StreamedRows:
    """The rows a streamed comparison job has compared so far (the finished table's first rows), its progress and
    state; given the previous answer `known`, only what was written since is read."""
    from ttrace_core.service.comparison_jobs import streamed_rows as rows_of

    return rows_of(job, known)


def streamed_comparison(reference: str | os.PathLike, candidate: str | os.PathLike, settings: CompareSettings | None,
                        rows_to: Path, *, rebuild: bool = False) -> VerdictSummary:
    """The comparison job's command: compare, writing the rows to `rows_to` as they come, then cache the table.
    The verdict is the table's provenance: the job's caller reads the table itself, so its rows are not made
    into records again (3 s for the 16,427 rows of a 48-layer pair)."""
    from ttrace_core.service.comparison_jobs import RowChunkWriter
    from ttrace_core.service.comparisons import comparison_table as table_of

    writer = RowChunkWriter(rows_to)
    result = table_of(reference, candidate, settings, progress=writer.progress, rebuild=rebuild, stream=writer)
    writer.finish(result.path)
    return verdict_of(result.provenance)


def finding_lines(findings: list[Finding]) -> list[str]:
    """One line per distinct finding, with where it recurred (format/findings.py)."""
    from ttrace_core.format.findings import finding_lines as lines

    return lines(findings)


def verdict_of(provenance: dict) -> VerdictSummary:
    """The verdict a comparison table's provenance records, with its first divergence and coverage."""
    return VerdictSummary.from_provenance(provenance)


def tensor_view(reference: str | os.PathLike, candidate: str | os.PathLike, tensor: str, step: int, micro_batch: int,
                region: tuple[slice, ...] | None = None, *, num_worst: int = 10) -> TensorView:
    """One tensor of both runs: canonical arrays, difference image, histogram, worst elements, shard map."""
    from pathlib import Path

    from ttrace_core.format.naming import key_from_tensor_id
    from ttrace_core.service.tensor_view import build_tensor_view

    key = key_from_tensor_id(tensor, step, micro_batch)
    return build_tensor_view(Path(reference), Path(candidate), key, region=region, num_worst=num_worst)


def submit_replay(reference: str | os.PathLike, candidate: str | os.PathLike, module: str | None = None, **kwargs) -> Job:
    """Start (or find) the localization replay of a candidate as a job (service/replays.py)."""
    from ttrace_core.service.replays import submit_replay as submit

    return submit(reference, candidate, module, **kwargs)


def replay_job(reference: str | os.PathLike, candidate: str | os.PathLike, module: str | None = None,
               settings: CompareSettings | None = None) -> Job | None:
    """The replay job of these runs, module and settings if one was ever submitted, else None."""
    from ttrace_core.service.replays import replay_job as job_of

    return job_of(reference, candidate, module, settings)


def replay_job_dir(reference: os.PathLike, candidate: os.PathLike, module: str | None,
                   settings: CompareSettings | None = None) -> os.PathLike:
    from ttrace_core.service.replays import replay_job_dir as directory_of

    return directory_of(reference, candidate, module, settings)


def localization(job: Job) -> Localization | None:
    """The `Localization` of a complete replay job, else None."""
    from ttrace_core.service.replays import localization as localization_of

    return localization_of(job)


# --- the rest of what the CLI does: record, estimate, localize in this process, check, inspect, serve ---


def record(out: str | os.PathLike, command: list[str], **kwargs) -> Path:
    """`ttrace record`: run a training command with tracing on (its script calls `ttrace_core.attach`); the run
    directory (record/command.py)."""
    from ttrace_core.record.command import record as record_command

    return record_command(out, command, **kwargs)


def record_adaptively(reference: str | os.PathLike, out: str | os.PathLike, record_stats: Callable[[Path], object], *,
                      timeout_s: float) -> AdaptiveCapture:
    """Statistics for every step (`record_stats(out)`), then values for the steps that matter (workflows/adaptive.py)."""
    from ttrace_core.workflows.adaptive import capture_adaptively

    return capture_adaptively(reference, out, record_stats, timeout_s=timeout_s)


def read_manifest(run_dir: str | os.PathLike) -> RunManifest:
    """A run directory's manifest; TraceFormatError in one line when it is not a run."""
    from ttrace_core.format.reader import read_manifest as read

    return read(run_dir)


def open_run(run_dir: str | os.PathLike) -> RunReader:
    """A run directory's reader, a context manager: manifest, steps, findings and tensor index (format/reader.py)."""
    from ttrace_core.format.reader import RunReader as Reader

    return Reader(run_dir)


def estimate(reference: str | os.PathLike, **kwargs) -> tuple[PerturbationEstimate, Path]:
    """`ttrace estimate`: re-run the reference with perturbed weights (workflows/estimate.py) and store each tensor's
    deviation in it; the estimate and the file it went to."""
    from ttrace_core.compare.estimate_file import write_estimate
    from ttrace_core.workflows.estimate import estimate_reference

    found = estimate_reference(reference, **kwargs)
    return found, write_estimate(reference, found)


def compare_in_workers(reference: str | os.PathLike, candidate: str | os.PathLike, settings: CompareSettings, *,
                       workers: int, rebuild: bool) -> RunComparison:
    """The comparison computed by `workers` local processes, each a part of the tensors (service/comparisons.py)."""
    from ttrace_core.service.comparisons import run_workers

    return run_workers(reference, candidate, settings, workers=workers, rebuild=rebuild)


def compare_as_rank(reference: str | os.PathLike, candidate: str | os.PathLike, settings: CompareSettings, *,
                    rebuild: bool) -> RunComparison | None:
    """This process's part of a comparison run by every rank of a torchrun launch; rank 0 gets the result, the
    others None."""
    from ttrace_core.service.comparisons import compare_distributed

    return compare_distributed(reference, candidate, settings, rebuild=rebuild)


def localize_here(reference: str | os.PathLike, candidate: str | os.PathLike, **kwargs) -> Localization:
    """The localization replay run in this process (workflows/localize.py): what a replay job runs."""
    from ttrace_core.workflows.localize import localize

    return localize(reference, candidate, **kwargs)


def read_check_config(path: str | os.PathLike) -> CheckConfig:
    """A `ttrace check` config (service/check_config.py); CheckConfigError in one line naming the file and key."""
    from ttrace_core.service.check_config import read_check_config as read

    return read(path)


def run_check(config: CheckConfig, **kwargs) -> CheckResult:
    """Every layout of a check config recorded, compared and localized against its reference (service/check.py)."""
    from ttrace_core.service.check import run_check as check

    return check(config, **kwargs)


def check_outputs(result: CheckResult) -> dict[str, str]:
    """What `ttrace check` writes, by its default file name: JUnit XML, the Markdown summary, the JSON."""
    from ttrace_core.service.check_outputs import check_json, junit_xml, markdown_summary

    return {"junit.xml": junit_xml(result), "summary.md": markdown_summary(result), "check.json": check_json(result)}


def serve_warm_worker(path: str, parent: int, command_main: Callable[[list[str]], int]) -> None:
    """The dashboard's warm worker (service/warm_worker.py): fork `command_main` (the CLI's main) for each job
    handed to it on the socket at `path`, until process `parent` (the server) is gone."""
    from ttrace_core.service.warm_worker import serve

    serve(path, parent, command_main)


def serve_dashboard(root: str | os.PathLike, **kwargs) -> int:
    """`ttrace dashboard`: serve the dashboard on the runs under `root` (this process becomes the server;
    `port`, `host`: service/dashboard.py)."""
    from ttrace_core.service.dashboard import serve

    return serve(root, **kwargs)
