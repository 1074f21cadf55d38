"""Recording the torchtitan and transformers cases of the corpus: `ttrace record` around torchrun, one
thread per process, a timeout on every spawn, torchrun's own free port (`--standalone`).

A reference several cases share (the same model, precision and layout) is recorded once per work
directory: it is reused when its `.recorded` marker, written after a successful record, is there.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support import warm_cli

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
RECORDED = ".recorded"


def ttrace(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`python -m ttrace_core ARGS` in `cwd`, output captured; raises when it times out (tests/support/warm_cli.py)."""
    return warm_cli.run(*args, cwd=cwd, timeout=timeout)


def record(out: Path, nproc: int, entry: list[str], *, timeout: float, reuse: bool = False) -> Path:
    """`ttrace record --out OUT -- torchrun --standalone --nproc-per-node NPROC ENTRY` (ENTRY: a script or
    `-m module`, then its arguments). A reused reference is recorded once; a failure raises with the log's tail."""
    if reuse and (out / RECORDED).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    command = ["torchrun", "--standalone", "--nproc-per-node", str(nproc), *entry]
    done = ttrace("record", "--out", out.name, "--timeout", str(int(timeout)), "--", *command, cwd=out.parent,
                  timeout=timeout + 60)
    (out.parent / f"{out.name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"ttrace record {out} exited {done.returncode}: {(done.stdout + done.stderr)[-3000:]}")
    (out / RECORDED).write_text("")
    return out


def estimate(run: Path, *, samples: int = 2, timeout: float) -> None:
    """`ttrace estimate RUN --samples N` once: the perturbation tolerances a bf16 (or bf16-computing) reference needs."""
    marker = run / ".estimated"
    if marker.exists():
        return
    done = ttrace("estimate", run.name, "--samples", str(samples), cwd=run.parent, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"ttrace estimate {run} exited {done.returncode}: {(done.stdout + done.stderr)[-3000:]}")
    marker.write_text("")
