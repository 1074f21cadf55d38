"""`ttrace check CONFIG`: every layout of a TOML config against its reference, as a CI gate
(api.run_check: service/check.py), with JUnit XML, a Markdown summary and JSON (api.check_outputs).

Exit code: 0 every layout equivalent, 1 any not equivalent or failing, 2 a bad config or input (a
reference that did not train included), 3 an internal error.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ttrace_core.cli.settings_flags import add_flags, settings_from_flags


def add_check_parser(commands, *, report_writer) -> None:
    """`ttrace check`; the HTML report writer comes from cli/main.py."""
    check = commands.add_parser("check", help="record and judge every layout of a TOML config against its reference "
                                              "(a CI gate: JUnit, Markdown summary, JSON)")
    check.add_argument("config", help="the TOML config: command, reference, [[candidate]] layouts, precisions, output")
    check.add_argument("--jobs", type=int, default=1,
                       help="record up to N candidates at once (never more ranks than cores)")
    check.add_argument("--junit", default=None, metavar="PATH", help="JUnit XML (default OUTPUT/junit.xml)")
    check.add_argument("--markdown", default=None, metavar="PATH",
                       help="the Markdown summary (default OUTPUT/summary.md); also appended to $GITHUB_STEP_SUMMARY "
                            "when that is set")
    check.add_argument("--json", default=None, metavar="PATH", help="every verdict as JSON (default OUTPUT/check.json)")
    check.add_argument("--no-html", action="store_true", help="do not write the HTML report of each failing layout")
    add_flags(check)
    check.set_defaults(handler=lambda args: run_check_command(
        args, settings_from_flags(args), None if args.no_html else _html_writer(report_writer)))


def _html_writer(report_writer):
    """The dashboard's HTML report writer, or None (with a warning) when the dashboard is not installed."""
    from ttrace_core.api import TtraceError

    try:
        write = report_writer("html")
    except TtraceError as error:
        print(f"ttrace: warning: no HTML reports: {error}", file=sys.stderr)
        return None
    return lambda reference, candidate, out, settings: write(reference, candidate, out, settings=settings)


def run_check_command(args: argparse.Namespace, settings, write_html) -> int:
    from ttrace_core.api import TtraceError, check_outputs, read_check_config, run_check

    if args.jobs < 1:
        raise TtraceError(f"--jobs {args.jobs}: give at least 1")
    config = read_check_config(args.config)
    result = run_check(config, jobs=args.jobs, settings=settings, write_html=write_html)
    written = check_outputs(result)
    chosen = {"junit.xml": args.junit, "summary.md": args.markdown, "check.json": args.json}
    outputs = {chosen[name] or config.output / name: text for name, text in written.items()}
    summary = written["summary.md"]
    for path, text in outputs.items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a") as step_summary:
            step_summary.write(summary)
    print(summary)
    print("wrote " + ", ".join(str(path) for path in outputs))
    return result.exit_code
