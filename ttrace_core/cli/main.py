"""`ttrace` command line: record, estimate, compare, localize, inspect, report, dashboard, and the
commands installed packages add (`example` and `bugs`, from ttrace_examples).

Exit codes: 0 the runs are equivalent (or the command succeeded), 1 a divergence was found (localize:
a culprit was named), 2 bad input (one line that names the file or tensor and says why), 3 an
internal error, 4 (localize) a divergence that the replay does not explain or does not reproduce.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from pathlib import Path

from importlib.metadata import entry_points

from ttrace_core.cli.check import add_check_parser
from ttrace_core.cli.record import add_record_parser
from ttrace_core.cli.settings_flags import add_flags, settings_from_flags
from ttrace_core import INSTALL_DASHBOARD
from ttrace_core.api import TtraceError, TtraceInternalError

PLUGIN_COMMANDS = "ttrace.commands"
"""Entry-point group of commands other packages add: each entry is `add_parser(commands)`, which sets
`handler` on its parser (ttrace_examples adds `example` and `bugs`)."""
REPORT_WRITERS = "ttrace.report_writers"
"""Entry-point group of `ttrace report -o` writers; `html` is the dashboard's (ttrace_dashboard.report)."""


def _add_plugin_commands(commands) -> None:
    for entry in sorted(entry_points(group=PLUGIN_COMMANDS), key=lambda e: e.name):
        try:
            entry.load()(commands)
        except Exception as error:  # a broken plugin must not take the other commands down
            print(f"ttrace: warning: command {entry.name!r} ({entry.value}) could not be loaded: {error}", file=sys.stderr)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ttrace", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_plugin_commands(commands)
    compare = commands.add_parser("compare", help="compare a candidate run against a reference run")
    compare.add_argument("reference", help=REFERENCE_HELP)
    compare.add_argument("candidate", help=CANDIDATE_HELP)
    compare.add_argument("--json", default=None, metavar="PATH",
                         help="write the full comparison as strict JSON here (NaN/inf as null); '-': to stdout, "
                              "and the table to stderr")
    compare.add_argument("--worst", type=int, default=10, help="how many worst offenders to list (default: %(default)s)")
    compare.add_argument("--progress", action="store_true", help="draw the progress bar even when stderr is not a terminal")
    compare.add_argument("--workers", type=int, default=1,
                         help="compare in N local worker processes, each a part of the tensors (default: %(default)s)")
    compare.add_argument("--distributed", action="store_true",
                         help="this process is one rank of a torchrun launch: every rank compares a part, rank 0 reports")
    compare.add_argument("--rebuild", action="store_true",
                         help="recompute even when the cached comparison table (under CAND/.ttrace) is up to date")
    compare.add_argument("--rows-to", default=None, metavar="DIR",
                         help="also write the table's rows to DIR in chunks as they are compared (the dashboard's "
                              "streamed comparison job reads them); only the verdict is printed, unless --json")
    add_flags(compare)
    _add_map_flag(compare)
    estimate = commands.add_parser("estimate", help="re-run the reference with perturbed weights to derive per-tensor tolerances")
    estimate.add_argument("reference", help="the reference run directory: it is re-run from its manifest, and the "
                                           "estimate is stored in it")
    estimate.add_argument("--samples", type=int, default=4,
                          help="perturbed re-runs (the deviation is their maximum; default: %(default)s)")
    estimate.add_argument("--relative", type=float, default=None,
                          help="perturbation size (default: the unit round-off of the run's compute dtype)")
    estimate.add_argument("--timeout", type=float, default=600.0,
                          help="seconds before a re-run's ranks are killed (default: %(default)s)")
    estimate.add_argument("--for-precision", default=None, choices=["fp32", "bf16", "fp8"],
                          help="re-run the reference in this precision (fp8 on a bf16 reference), for candidates that "
                               "compute in it: their tolerances then include its quantization")
    estimate.add_argument("--keep-samples", action="store_true",
                          help="keep the re-runs under REFERENCE/.estimate/ and reuse complete ones (re-measure without re-running)")
    localize = commands.add_parser("localize", help="relaunch the candidate with module inputs rewritten to the reference's, name the culprit")
    localize.add_argument("reference", help=REFERENCE_HELP)
    localize.add_argument("candidate", help=CANDIDATE_HELP + "; it is relaunched from its manifest")
    localize.add_argument("--module", default=None, help="rewrite and judge only this module and its descendants")
    localize.add_argument("--json", default=None, metavar="PATH",
                          help="write the localization as strict JSON here (NaN/inf as null); '-': to stdout, "
                               "and the report to stderr")
    localize.add_argument("--timeout", type=float, default=600.0,
                          help="seconds before the replay's ranks are killed (default: %(default)s)")
    localize.add_argument("--rerun", action="store_true", help="replay again even when a finished replay of these runs exists")
    add_flags(localize)
    _add_map_flag(localize)
    localize.add_argument("--here", action="store_true", help=argparse.SUPPRESS)  # run in this process (what the job runs)
    localize.add_argument("--replay-dir", default=None, help=argparse.SUPPRESS)
    inspect = commands.add_parser("inspect", help="list what a run directory holds")
    inspect.add_argument("run_dir", help="a run directory (the folder that holds manifest.json)")
    inspect.add_argument("--tensors", action="store_true", help="list every logical tensor")
    add_check_parser(commands, report_writer=_report_writer)
    add_record_parser(commands)
    report = commands.add_parser("report", help="write a self-contained HTML report, or a Markdown summary for a review")
    report.add_argument("reference", help=REFERENCE_HELP)
    report.add_argument("candidate", help=CANDIDATE_HELP)
    report.add_argument("-o", "--out", default=None, help="write the HTML report here (opens offline, no Python needed)")
    report.add_argument("--markdown", action="store_true", help="print a short Markdown summary (verdict, first "
                                                                  "divergence, culprit, evidence)")
    add_flags(report)
    _add_map_flag(report)
    dashboard = commands.add_parser("dashboard", help="browse comparisons of the runs under ROOT in a web dashboard")
    dashboard.add_argument("root", nargs="?", default=".", help="folder holding run directories (searched recursively)")
    dashboard.add_argument("--port", type=int, default=None,
                           help="port to serve on; it must be free (default: the first free one from 8501)")
    dashboard.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    for name, subparser in commands.choices.items():  # every command (the installed packages' too) gets a paragraph
        if subparser.description is None:
            summary = next((action.help for action in commands._choices_actions if action.dest == name), None)
            subparser.description = DESCRIPTIONS.get(name, summary)
    return parser


REFERENCE_HELP = "the reference run directory (single rank; recorded by ttrace record, ttrace example or a Tracer)"
CANDIDATE_HELP = "the candidate run directory (the distributed run to judge against the reference)"
DESCRIPTIONS = {
    "compare": "Compare a candidate run against a reference run, tensor by tensor, each against its derived tolerance. "
               "Prints the verdict, the first divergence and the worst offenders. Exit 0 when equivalent, 1 when not, "
               "2 on bad input (a run compared with itself, or the two swapped, is refused).",
    "estimate": "Re-run the reference with its weights perturbed by one unit of round-off, several times, and store "
                "each tensor's deviation in the reference: compare then derives per-tensor tolerances from it.",
    "localize": "Relaunch the candidate from its manifest with the inputs of every traced module (or of --module and "
                "its descendants) rewritten to the reference's, and name the module that introduces the error. "
                "Exit 1 when a culprit is named, 4 when the divergence is not explained.",
    "inspect": "List what a run directory holds: its manifest (role, layout, steps) and, with --tensors, every "
               "logical tensor.",
    "report": "Write the comparison as one self-contained HTML file (-o; opens offline) or print a short Markdown "
              "summary for a review (--markdown).",
    "dashboard": "Serve the web dashboard on the runs under ROOT: pick a pair on Runs, open its heatmap, click the "
                 "first divergence, replay a module on Localize. Stop it with Ctrl-C.",
}
"""The paragraph under each command's usage; a command without one gets its one-line help."""


def _add_map_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--map", default=None, metavar="NAME|FILE",
                        help="the reference is another implementation of the model (a Hugging Face model for a megatron "
                             "candidate): relate its tensors to the candidate's through this correspondence map, a "
                             "shipped one by name (hf-llama--megatron-gpt) or a .toml file (docs/porting.md)")


def _through_map(args: argparse.Namespace) -> None:
    """With --map, the reference becomes its mapped copy (made, or reused when up to date), named on stderr."""
    if not getattr(args, "map", None):
        return
    from ttrace_core.api import mapped_reference

    args.reference = str(mapped_reference(args.reference, args.map, progress=lambda line: print(line, file=sys.stderr)))
    args.map = None


def _check_output_path(path: str | None, flag: str) -> None:
    """Refuse an output file whose folder is missing before any work is done, not after it."""
    if path is None or (path == "-" and flag == "--json"):
        return
    if Path(path).is_dir():
        raise TtraceError(f"{flag} {path}: is a directory; pass a file name")
    if not Path(path).resolve().parent.is_dir():
        raise TtraceError(f"{flag} {path}: folder {Path(path).resolve().parent} does not exist; create it first")


def _human_stream(args: argparse.Namespace):
    """Where the human-readable report goes: stderr when `--json -` has stdout for the JSON."""
    return sys.stderr if getattr(args, "json", None) == "-" else sys.stdout


def _write_json(destination: str, text: str) -> None:
    if destination == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    else:
        Path(destination).write_text(text)


def _refuse_meaningless_pair(args: argparse.Namespace) -> None:
    """A run compared with itself, or a swapped pair, is refused (exit 2, one line) rather than judged: the first
    always passes, the second takes its tolerances from the candidate; either verdict would mislead silently."""
    from ttrace_core.api import pair_problem

    problem = pair_problem(args.reference, args.candidate)
    if problem is not None:
        raise TtraceError(problem)


def _run_compare(args: argparse.Namespace) -> int:
    from ttrace_core.api import run_comparison
    from ttrace_core.cli.report import ProgressBar, render_comparison

    _through_map(args)
    _refuse_meaningless_pair(args)
    settings = settings_from_flags(args)
    _check_output_path(args.json, "--json")
    progress = ProgressBar(enabled=args.progress or sys.stderr.isatty())
    if args.workers > 1 or args.distributed:
        from ttrace_core.api import compare_as_rank, compare_in_workers

        if args.distributed:
            result = compare_as_rank(args.reference, args.candidate, settings, rebuild=args.rebuild)
            if result is None:  # not rank 0: rank 0 prints and writes
                return 0
        else:
            result = compare_in_workers(args.reference, args.candidate, settings, workers=args.workers, rebuild=args.rebuild)
    elif args.rows_to:
        from ttrace_core.api import streamed_comparison

        summary = streamed_comparison(args.reference, args.candidate, settings, Path(args.rows_to), rebuild=args.rebuild)
        if not args.json:  # a dashboard's job: the page reads the table, the job's log says the verdict
            print(summary.banner()[1], file=_human_stream(args))
            return 0 if summary.passed else 1
        result = run_comparison(args.reference, args.candidate, settings)  # the table just cached
    else:
        result = run_comparison(args.reference, args.candidate, settings, progress=progress, rebuild=args.rebuild)
    print(render_comparison(result, num_worst=args.worst), file=_human_stream(args))
    if args.json:
        _write_json(args.json, result.to_json())
    return 0 if result else 1


def _report_writer(name: str):
    """The `ttrace report -o` writer an installed package registered (the dashboard's HTML), found by name."""
    found = [entry for entry in entry_points(group=REPORT_WRITERS) if entry.name == name]
    if not found:
        raise TtraceError(f"the {name.upper()} report is drawn by the dashboard, which is not installed in {sys.prefix}; "
                          f"install it: {INSTALL_DASHBOARD}")
    try:
        return found[0].load()
    except ModuleNotFoundError as error:
        raise TtraceError(f"the {name.upper()} report needs {error.name}, not installed in {sys.prefix}; "
                          f"{INSTALL_DASHBOARD}") from error


def _run_report(args: argparse.Namespace) -> int:
    from ttrace_core.api import localization, replay_job, run_comparison
    from ttrace_core.cli.report import render_markdown

    if not args.out and not args.markdown:
        raise TtraceError("report: nothing to write; pass -o report.html for the HTML report, --markdown for a "
                          "summary, or both")
    _check_output_path(args.out, "-o")
    _through_map(args)
    _refuse_meaningless_pair(args)
    settings = settings_from_flags(args)
    result = run_comparison(args.reference, args.candidate, settings)
    if args.out:
        # The HTML is drawn by the dashboard's figure builders (the render stage, which may use plotly),
        # found through its entry point: the core never imports the dashboard.
        write_report = _report_writer("html")
        path = write_report(args.reference, args.candidate, args.out, settings=settings)
        print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB); it opens offline in any browser")
    if args.markdown:
        job = replay_job(args.reference, args.candidate, settings=settings)
        print(render_markdown(result, localization(job) if job is not None else None))
    return 0 if result else 1


def _run_dashboard(args: argparse.Namespace) -> int:
    from ttrace_core.api import serve_dashboard

    return serve_dashboard(args.root, port=args.port, host=args.host)


def _run_estimate(args: argparse.Namespace) -> int:
    from ttrace_core.api import estimate as estimate_reference

    estimate, path = estimate_reference(args.reference, num_samples=args.samples, relative=args.relative,
                                        timeout_s=args.timeout, for_precision=args.for_precision,
                                        keep_samples=args.keep_samples)
    relatives = sorted(d.relative for d in estimate.tensors.values() if math.isfinite(d.relative))
    median = relatives[len(relatives) // 2] if relatives else float("nan")
    crossed = f" in {estimate.precision}" if estimate.precision != estimate.reference_precision else ""
    print(f"estimated {len(estimate.tensors)} tensors from {estimate.num_samples} re-runs{crossed} with weights perturbed by "
          f"U[-{estimate.relative:.3g}, {estimate.relative:.3g}] ({estimate.seconds:.0f} s); median relative deviation "
          f"{median:.3g}, largest {relatives[-1] if relatives else float('nan'):.3g}; stored in {path}")
    return 0


def _localize_here(args: argparse.Namespace) -> int:
    """The replay itself, in this process: what a localize job runs."""
    from ttrace_core.api import localize_here, run_comparison
    from ttrace_core.cli.report import render_localization

    started = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[progress] {message} (t={time.perf_counter() - started:.1f} s)", flush=True)

    _check_output_path(args.json, "--json")
    _through_map(args)
    settings = settings_from_flags(args)
    original = run_comparison(args.reference, args.candidate, settings)
    result = localize_here(args.reference, args.candidate, module=args.module, timeout_s=args.timeout,
                           original=original, replay_dir=args.replay_dir, progress=progress, settings=settings)
    progress("done")
    print(render_localization(result), file=_human_stream(args))
    if args.json:
        _write_json(args.json, result.to_json())
    return result.exit_code


def _run_localize(args: argparse.Namespace) -> int:
    """Submit the replay as a job (or reuse the finished one), follow its log, print its verdict."""
    if args.here:
        return _localize_here(args)
    from ttrace_core.api import localization, submit_replay
    from ttrace_core.cli.report import render_localization

    _check_output_path(args.json, "--json")
    _through_map(args)
    _refuse_meaningless_pair(args)
    job = submit_replay(args.reference, args.candidate, args.module, timeout_s=args.timeout, rerun=args.rerun,
                        settings=settings_from_flags(args))
    if job.cached:
        print(f"(cached replay: {job.directory})", file=_human_stream(args))
    status = job.wait()
    result = localization(job)
    if result is None:
        tail = "\n".join(job.log_tail(15))
        error_line = next((line for line in reversed(job.log_tail(15)) if line.startswith("ttrace: error:")), None)
        if error_line:
            print(error_line, file=sys.stderr)
            return 2
        raise TtraceInternalError(f"the localize job {status.state} ({status.message}); its log ends with:\n{tail}")
    print(render_localization(result), file=_human_stream(args))
    if args.json:
        _write_json(args.json, result.to_json())
    return result.exit_code


def _run_inspect(args: argparse.Namespace) -> int:
    from ttrace_core.api import open_run
    from ttrace_core.cli.report import render_run

    with open_run(args.run_dir) as reader:
        print(render_run(reader, list_tensors=args.tensors))
    return 0


REPORT_IT = "this is a bug in ttrace: please report it on the ttrace issue tracker"


def _internal_error(error: Exception) -> int:
    """A bug of ttrace's own: say so, with the traceback for the report."""
    traceback.print_exc()
    print(f"ttrace: internal error: {type(error).__name__}: {error}; {REPORT_IT} with the traceback above",
          file=sys.stderr)
    return 3


def main(argv: list[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):  # a damaged trace's names may not be valid UTF-8: print them escaped
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    args = _build_parser().parse_args(argv)
    handlers = {"estimate": _run_estimate, "compare": _run_compare, "localize": _run_localize,
                "inspect": _run_inspect, "dashboard": _run_dashboard, "report": _run_report}
    try:
        code = (getattr(args, "handler", None) or handlers[args.command])(args)
        sys.stdout.flush()  # a reader that went away (`| head`) shows here, not at the interpreter's exit
        return code
    except TtraceError as error:
        print(f"ttrace: error: {error}".replace("\n", " "), file=sys.stderr)
        return 2
    except TtraceInternalError as error:
        print(f"ttrace: internal error: {error}\n{REPORT_IT} with the output above", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("ttrace: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (`ttrace ... | head`): stop quietly, as SIGPIPE would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit must not fail again
        return 141
    except OSError as error:
        if error.filename is None:
            return _internal_error(error)
        # A path the user gave (or its folder) cannot be read or written: input or environment, not a bug.
        print(f"ttrace: error: {error.filename}: {error.strerror or error}; check the path, its folder and "
              "their permissions", file=sys.stderr)
        return 2
    except Exception as error:
        return _internal_error(error)


if __name__ == "__main__":
    sys.exit(main())
