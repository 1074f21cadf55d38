"""Helpers for the CLI's tests: `ttrace` in this process, and replay jobs as a finished one leaves them."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from ttrace_core import api
from ttrace_core.cli.main import main as ttrace_main
from ttrace_core.service.jobs import JobSpec
from ttrace_core.localize.verdicts import Evidence, Localization, ModuleVerdict


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    """`ttrace ARGV` in this process: (exit code, stdout, stderr); argparse's usage errors exit too."""
    try:
        code = ttrace_main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


# Modules whose (pretend) finished replays answer `localize --module FQN`, by the exit code they carry.
REPLAYED = {"layers.0.lin": 0, "layers.0.act": 1, "layers.1": 4}


def localization_for(exit_code: int) -> Localization:
    """A replay's verdict that maps to `exit_code` (Localization.exit_code)."""
    culprits = ["layers.0.act"] if exit_code == 1 else []
    evidence = [Evidence(key="step 0 / mb 0 / forward / layers.0.act / output.0", ratio_before=6e4,
                         ratio_after=float("inf"), status="mismatch")]
    return Localization(reference="r", candidate="c", replay="x", diverged=exit_code != 0, culprits=culprits,
                        bug_class="forward" if culprits else "",
                        modules=[ModuleVerdict(fqn="layers.0.act", verdict="introduces error" if culprits else "clean",
                                               phase="forward", evidence=evidence)],
                        command="ttrace localize r c",
                        reproduction={"reproduced": True, "num_checked": 3, "mismatches": [], "differences": []})


def write_finished_replay(reference: Path, candidate: Path, module: str | None, localization: Localization) -> Path:
    """The job directory `api.submit_replay` would find complete: a cache hit, so nothing is relaunched."""
    directory = api.replay_job_dir(reference.resolve(), candidate.resolve(), module)
    directory.mkdir(parents=True)
    spec = JobSpec(command=["true"], env={}, cwd=str(candidate), success_codes=api.LOCALIZE_EXIT_CODES)
    (directory / "spec.json").write_text(json.dumps(asdict(spec)))
    (directory / "status.json").write_text(json.dumps({"state": "complete", "pid": 1, "exit_code": localization.exit_code,
                                                       "message": "", "started": time.time() - 1, "finished": time.time()}))
    (directory / "log.txt").write_text("[progress] done\n")
    (directory / "result.json").write_text(localization.to_json())
    return directory


def ttrace_command(*args: str, cwd: Path, timeout: float = 400):
    """`python -m ttrace_core ARGS` in `cwd`, one thread per process, output captured (tests/support/warm_cli.py)."""
    from tests.support import warm_cli

    return warm_cli.run(*args, cwd=cwd, timeout=timeout)


def record_script(script: Path, out: Path, nproc: int, *flags: str) -> None:
    """`ttrace record` of `torchrun --nproc-per-node NPROC SCRIPT FLAGS` into `out`."""
    command = ["torchrun", "--standalone", "--nproc-per-node", str(nproc), str(script), *flags]
    done = ttrace_command("record", "--out", str(out), "--timeout", "240", "--", *command, cwd=out.parent)
    assert done.returncode == 0, done.stderr[-3000:]
