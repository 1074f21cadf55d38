"""`ttrace check CONFIG`: every layout of a config against its reference, as a gate (check_config.py).

For each precision: record the reference once (and estimate its tolerances), refuse to go on when it
did not train, then record every candidate, compare it, and replay each failing one to name its
culprit. A recording is reused while its inputs are unchanged: the command, the environment's
fingerprint and the hash of the code (`recording_inputs`), kept beside the run as
`<name>.inputs.json`. Comparisons and replays reuse their own caches (comparisons.py, replays.py).
A layout whose command fails is that layout's error, with its log's tail; the others still run.
With a `map` (another implementation as the reference, docs/porting.md), the recorded reference is
rewritten through it once per precision (`mapped_through`), and the candidates are judged against that.

Output: a `CheckResult` (one `LayoutResult` per layout and precision), which check_outputs.py writes
as JUnit XML, a Markdown summary and JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ttrace_core.compare.liveness import reference_liveness
from ttrace_core.compare.results import RunComparison
from ttrace_core.compare.settings import CompareSettings
from ttrace_core.errors import TtraceError
from ttrace_core.format.fingerprint import environment_fingerprint
from ttrace_core.format.naming import tensor_id
from ttrace_core.format.reader import RunReader
from ttrace_core.format.records import data_from_record
from ttrace_core.service.check_config import CheckConfig, CheckConfigError, Layout
from ttrace_core.service.comparisons import comparison_table, ttrace_version

LOG_TAIL_LINES = 20
NUM_FIRST_FAILURES = 10
HtmlWriter = Callable[[Path, Path, Path, CompareSettings], Path]
"""(reference, candidate, out, settings) -> the written report: the dashboard's HTML report (`ttrace report -o`)."""


class ReferenceRefused(TtraceError):
    """The reference cannot judge anything (it did not train): exit code 2."""


@dataclass(kw_only=True, slots=True)
class LayoutResult:
    name: str
    precision: str
    layout: str
    world_size: int
    outcome: str
    """"equivalent" (the verdict passed), "not equivalent" (it failed: a divergence, refused or incomplete
    evidence) or "error" (the layout's command failed, or its trace could not be compared)."""
    message: str
    """One line: the verdict's headline and first divergence, or the error."""
    verdict: str = ""
    first_divergence: str = ""
    ratio: float | None = None
    culprit: str = ""
    details: list[str] = field(default_factory=list)
    """The verdict's findings and worst tensors, one line each (the JUnit failure's body)."""
    findings: list[str] = field(default_factory=list)
    coverage: dict | None = None
    run_dir: str = ""
    log: str = ""
    log_tail: list[str] = field(default_factory=list)
    report: str = ""
    """The HTML report of a failing pair."""
    reused: bool = False
    """Its recording was reused (inputs unchanged)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """record, compare, localize."""


@dataclass(kw_only=True, slots=True)
class CheckResult:
    config: str
    output: str
    layouts: list[LayoutResult]
    references: dict[str, dict] = field(default_factory=dict)
    """Per precision: the reference's run directory, whether it was reused, its seconds."""
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        return 0 if all(layout.outcome == "equivalent" for layout in self.layouts) else 1


def code_hash(config: CheckConfig) -> str:
    """What the recordings' code is: the files `config.code` names, else the git repository's files
    around `cwd` (tracked and untracked, not ignored), else the files the command names."""
    if config.code:
        files = sorted({p for pattern in config.code for p in config.cwd.glob(pattern) if p.is_file()})
    else:
        files = _git_files(config.cwd) or sorted(config.cwd / part for part in config.command
                                                  if (config.cwd / part).is_file())
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(config.cwd) if path.is_relative_to(config.cwd) else path).encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _git_files(cwd: Path) -> list[Path]:
    try:
        listed = subprocess.run(["git", "-C", str(cwd), "ls-files", "-z", "-co", "--exclude-standard", "--full-name"],
                                capture_output=True, timeout=60, check=True).stdout
        top = subprocess.run(["git", "-C", str(cwd), "rev-parse", "--show-toplevel"], capture_output=True, timeout=60,
                             check=True).stdout.decode().strip()
    except (OSError, subprocess.SubprocessError):
        return []
    return sorted(p for name in listed.decode().split("\0") if name and (p := Path(top) / name).is_file())


def recording_inputs(config: CheckConfig, command: list[str], role: str, code: str) -> dict:
    environment = {k: v for k, v in environment_fingerprint().items() if k not in ("command", "world_size")}
    return {"command": command, "cwd": str(config.cwd), "role": role, "environment": environment, "code": code,
            "ttrace": ttrace_version()}


def log_path(config: CheckConfig, layout: Layout, precision: str) -> Path:
    """Where a layout's recording writes its command's output, beside its run directory."""
    return config.output / precision / f"{layout.name}.log"


def _reusable(run_dir: Path, inputs_file: Path, inputs: dict) -> bool:
    try:
        return (run_dir / "manifest.json").is_file() and json.loads(inputs_file.read_text()) == inputs
    except (OSError, ValueError):
        return False


def record_layout(config: CheckConfig, layout: Layout, precision: str, role: str, code: str) -> tuple[Path, bool, float]:
    """Record one layout into OUTPUT/PRECISION/NAME (its log beside it), or reuse the recording whose inputs
    are unchanged. Returns (run directory, reused, seconds)."""
    from ttrace_core.record.command import record

    directory = config.output / precision
    run_dir, inputs_file, log = directory / layout.name, directory / f"{layout.name}.inputs.json", log_path(config, layout, precision)
    command = config.command_for(layout, precision)
    inputs = recording_inputs(config, command, role, code)
    if _reusable(run_dir, inputs_file, inputs):
        return run_dir, True, 0.0
    shutil.rmtree(run_dir, ignore_errors=True)
    inputs_file.unlink(missing_ok=True)
    directory.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log, "w") as output:
        output.write(f"$ {shlex.join(command)}\n")
        output.flush()
        record(run_dir, command, role=role, timeout_s=config.timeout_s, cwd=config.cwd, output=output)
    inputs_file.write_text(json.dumps(inputs, indent=1))
    return run_dir, False, time.perf_counter() - started


def log_tail(config: CheckConfig, layout: Layout, precision: str) -> list[str]:
    try:
        return log_path(config, layout, precision).read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    except OSError:
        return []


def prepare_reference(config: CheckConfig, precision: str, code: str) -> tuple[Path, dict]:
    """The precision's reference, recorded (or reused) and estimated; ReferenceRefused if it did not train."""
    from ttrace_core.compare.estimate_file import estimate_files, write_estimate
    from ttrace_core.workflows.estimate import estimate_reference

    try:
        run_dir, reused, seconds = record_layout(config, config.reference, precision, "reference", code)
    except TtraceError as error:
        log = log_path(config, config.reference, precision)
        raise ReferenceRefused(f"the reference ({precision}) could not be recorded: {error}; its log: {log}") from None
    with RunReader(run_dir) as reader:
        liveness = reference_liveness(reader, reader.complete_steps)
    if liveness.trained is False:
        raise ReferenceRefused(f"{run_dir}: the reference did not train ({liveness.why_not}); a pass against it would "
                               "mean nothing: fix the reference run (its loss, learning rate or optimizer) and check again")
    estimated = 0.0
    if not (reused and estimate_files(run_dir)):
        started = time.perf_counter()
        write_estimate(run_dir, estimate_reference(run_dir, num_samples=config.estimate_samples, timeout_s=config.timeout_s))
        estimated = time.perf_counter() - started
    return run_dir, {"run_dir": str(run_dir), "reused": reused, "record_s": round(seconds, 3), "estimate_s": round(estimated, 3)}


def mapped_through(reference: Path, map_name: str, progress: Callable[[str], None]) -> Path:
    """The reference, another implementation, rewritten through the config's map into the candidates' names and
    layouts (workflows/mapped_reference.py): what every candidate is compared with and replayed against.
    ReferenceRefused (exit 2) when the map does not fit the recorded reference."""
    from ttrace_core.errors import MapError
    from ttrace_core.workflows.mapped_reference import mapped_reference

    try:
        return mapped_reference(reference, map_name, progress=progress)
    except MapError as error:
        raise ReferenceRefused(f"{reference}: the map does not fit the reference ({error})") from None


def _culprit(reference: Path, candidate: Path, config: CheckConfig, settings: CompareSettings) -> tuple[str, float]:
    from ttrace_core.service.replays import localization, submit_replay

    started = time.perf_counter()
    job = submit_replay(reference, candidate, None, timeout_s=config.timeout_s, settings=settings)
    job.wait()
    found = localization(job)
    culprit = ", ".join(found.culprits) if found is not None and found.culprits else ""
    return culprit, time.perf_counter() - started


def _details(result: RunComparison) -> list[str]:
    """The findings, then the first failing tensors in execution order (the first divergence first: what
    follows it mostly inherits its error)."""
    lines = [f"finding: {finding}" for finding in result.findings]
    failures = result.failures
    for row in failures[:NUM_FIRST_FAILURES]:
        ratio = "-" if row.ratio is None else f"{row.ratio:.3g}"
        lines.append(f"{row.status}: {row.key}: ratio {ratio}: {row.message}")
    if len(failures) > NUM_FIRST_FAILURES:
        lines.append(f"... and {len(failures) - NUM_FIRST_FAILURES} more failing tensors")
    return lines


def judge_layout(config: CheckConfig, layout: Layout, precision: str, reference: Path, candidate: Path,
                 settings: CompareSettings, write_html: HtmlWriter | None) -> LayoutResult:
    """Compare a recorded candidate with its reference; localize and report it when it fails."""
    from ttrace_core.compare.table import comparison_from_table

    started = time.perf_counter()
    table = comparison_table(reference, candidate, settings)
    result = comparison_from_table(table.frame, table.provenance)
    summary, first = result.summary(), result.first_divergence
    found = LayoutResult(name=layout.name, precision=precision, layout=shlex.join(layout.args), world_size=layout.world_size,
                         outcome="equivalent" if result else "not equivalent", message=summary.headline(),
                         verdict=result.verdict, details=_details(result), findings=result.findings,
                         coverage=None if result.coverage is None else data_from_record(result.coverage),
                         run_dir=str(candidate), seconds={"compare": round(time.perf_counter() - started, 3)})
    if first is not None:
        found.first_divergence, found.ratio = f"step {first.key.step} {tensor_id(first.key)}", first.ratio
        found.message += f": first divergence at {found.first_divergence}" + (
            "" if first.ratio is None else f", ratio {first.ratio:.3g}")
    elif result.findings:
        found.message += f": {result.findings[0]}"
    if not result:
        if config.localize and first is not None:
            found.culprit, seconds = _culprit(reference, candidate, config, settings)
            found.seconds["localize"] = round(seconds, 3)
            if found.culprit:
                found.message += f"; culprit {found.culprit}"
        if write_html is not None:
            out = config.output / "reports" / f"{precision}-{layout.name}.html"
            out.parent.mkdir(parents=True, exist_ok=True)
            found.report = str(write_html(reference, candidate, out, settings))
    return found


def _error(layout: Layout, precision: str, config: CheckConfig, error: Exception) -> LayoutResult:
    line = str(error).splitlines()[0] if str(error) else type(error).__name__
    return LayoutResult(name=layout.name, precision=precision, layout=shlex.join(layout.args), world_size=layout.world_size,
                        outcome="error", message=line, log=str(log_path(config, layout, precision)),
                        log_tail=log_tail(config, layout, precision))


def run_check(config: CheckConfig, *, jobs: int = 1, settings: CompareSettings | None = None,
              write_html: HtmlWriter | None = None, progress: Callable[[str], None] = print) -> CheckResult:
    """Every candidate of `config` in every precision, judged against that precision's reference."""
    settings = settings or CompareSettings()
    if not config.cwd.is_dir():
        raise CheckConfigError(f"{config.path}: cwd {config.cwd} is not a directory")
    started = time.perf_counter()
    code = code_hash(config)
    check = CheckResult(config=str(config.path), output=str(config.output), layouts=[])
    for precision in config.precisions:
        reference, check.references[precision] = prepare_reference(config, precision, code)
        progress(f"[{precision}] reference {'reused' if check.references[precision]['reused'] else 'recorded'}: {reference}")
        if config.map is not None:
            reference = mapped_through(reference, config.map, progress)
            check.references[precision]["mapped"] = str(reference)
        recorded = _record_candidates(config, precision, code, jobs)
        for layout in config.candidates:
            outcome = recorded[layout.name]
            if isinstance(outcome, Exception):
                found = _error(layout, precision, config, outcome)
            else:
                run_dir, reused, seconds = outcome
                try:
                    found = judge_layout(config, layout, precision, reference, run_dir, settings, write_html)
                except TtraceError as error:
                    found = _error(layout, precision, config, error)
                found.reused, found.seconds["record"], found.run_dir = reused, round(seconds, 3), str(run_dir)
                found.log = str(log_path(config, layout, precision))
            check.layouts.append(found)
            progress(f"[{precision}] {layout.name}: {found.outcome.upper()}: {found.message}")
    check.seconds = round(time.perf_counter() - started, 3)
    return check


def _record_candidates(config: CheckConfig, precision: str, code: str, jobs: int) -> dict[str, tuple | Exception]:
    """Record every candidate, `jobs` at a time but never more ranks than cores; a failure is that layout's."""
    widest = max(layout.world_size for layout in config.candidates)
    workers = max(1, min(jobs, (os.cpu_count() or 1) // widest or 1))

    def one(layout: Layout) -> tuple | Exception:
        try:
            return record_layout(config, layout, precision, "candidate", code)
        except TtraceError as error:
            return error

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip((c.name for c in config.candidates), pool.map(one, config.candidates)))

