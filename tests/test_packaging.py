"""`pip install <repo>` (not editable) into a fresh venv gives a `ttrace` that runs.

The install takes requirements.txt as constraints, so it gets the pinned CPU build of torch (pip
finds it on this machine's disk; an unconstrained resolver may take a multi-GB CUDA build). The
venv then records and inspects a one-layer run, and the dashboard, packaged with its pages, refuses
in one line without its extra and renders its Runs page with it. About 2 minutes on 2 cores: 50-80 s
for the venv and the install (mostly unpacking torch), 20-30 s for the dashboard's extra.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ttrace_core import INSTALL_DASHBOARD

from tests.app.server import free_port, wait_healthy
from tests.conftest import ROOT
from tests.synthetic_runs import write_pair

pytestmark = pytest.mark.slow_install

# What the build reads, without the recorded samples and local state (setuptools would also leave
# build/ and *.egg-info in the checkout it builds from, so it builds from a copy).
NOT_COPIED = shutil.ignore_patterns(".git", "sample_traces", "runs", "build", "*.egg-info", "__pycache__",
                                    ".pytest_cache", ".ttrace", ".localize", "*.whl")


def pinned_version(package: str) -> str:
    text = (ROOT / "requirements.txt").read_text()
    (version,) = re.findall(rf"^{re.escape(package)}==(\S+)", text, flags=re.MULTILINE)
    return version


def run(command: list, *, cwd: Path, timeout: float = 600, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    # No PYTHONPATH: the venv must run its own installed copy, not this checkout.
    env = {name: value for name, value in os.environ.items() if name not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**env, "OMP_NUM_THREADS": "1", **(extra_env or {})})


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("packaging")
    source = work / "ttrace-source"
    shutil.copytree(ROOT, source, ignore=NOT_COPIED)
    started = time.perf_counter()
    created = run([sys.executable, "-m", "venv", work / "venv"], cwd=work)
    assert created.returncode == 0, created.stderr
    installed = run([work / "venv" / "bin" / "python", "-m", "pip", "install", "--no-input", "-c",
                     source / "requirements.txt", source], cwd=work, timeout=900)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    print(f"\nfresh venv + pip install: {time.perf_counter() - started:.0f} s")
    return work / "venv"


def test_the_install_has_the_pinned_cpu_torch(venv):
    probe = run([venv / "bin" / "python", "-c", "import torch; print(torch.__version__, torch.version.cuda)"], cwd=venv)
    assert probe.returncode == 0, probe.stderr
    version, cuda = probe.stdout.split()
    assert version.split("+")[0] == pinned_version("torch") and cuda == "None", probe.stdout
    listed = run([venv / "bin" / "python", "-m", "pip", "list", "--format=freeze"], cwd=venv).stdout
    assert not re.search(r"^nvidia-", listed, flags=re.MULTILINE), listed
    for package in ("numpy", "h5py", "pandas", "pyarrow"):
        assert f"{package}=={pinned_version(package)}" in listed.splitlines(), listed


def test_help_and_bugs_run(venv):
    help_ = run([venv / "bin" / "ttrace", "--help"], cwd=venv)
    assert help_.returncode == 0, help_.stderr
    assert all(command in help_.stdout for command in ("example", "compare", "estimate", "localize", "inspect", "bugs",
                                                       "report", "dashboard")), help_.stdout
    bugs = run([venv / "bin" / "ttrace", "bugs"], cwd=venv)
    assert bugs.returncode == 0 and "rowwise-skip-allreduce" in bugs.stdout and "sp-final-norm-grad" in bugs.stdout


def test_records_and_inspects_a_run(venv, tmp_path):
    out = tmp_path / "run"
    recorded = run([venv / "bin" / "ttrace", "example", "torch-gpt", "--out", out, "--num-layers", "1"], cwd=tmp_path)
    assert recorded.returncode == 0, recorded.stderr
    inspected = run([venv / "bin" / "ttrace", "inspect", out], cwd=tmp_path)
    assert inspected.returncode == 0, inspected.stderr
    assert "role: reference  world_size: 1" in inspected.stdout and "complete steps: [0]" in inspected.stdout
    where = run([venv / "bin" / "python", "-c", "import ttrace_core; print(ttrace_core.__file__)"], cwd=tmp_path)
    assert Path(where.stdout.strip()).is_relative_to(venv), "the venv ran this checkout, not its installed copy"


def test_the_dashboard_ships_its_pages_and_needs_its_extra(venv, tmp_path):
    locate = "from ttrace_core.service.dashboard import app_entrypoint; print(app_entrypoint())"
    entrypoint = Path(run([venv / "bin" / "python", "-c", locate], cwd=tmp_path).stdout.strip())
    assert entrypoint.is_file() and entrypoint.is_relative_to(venv) and entrypoint.parent.name == "ttrace_dashboard"
    pages = entrypoint.parent / "views"  # not "pages": Streamlit's legacy multipage folder
    assert not (entrypoint.parent / "pages").exists()
    assert sorted(p.name for p in pages.glob("*.py")) == sorted(p.name for p in (ROOT / "pages").glob("*.py"))
    # no generic top-level name in site-packages: the dashboard is `ttrace_dashboard`, the examples `ttrace_examples`
    for generic in ("app", "pages", "examples"):
        found = run([venv / "bin" / "python", "-c", f"import {generic}"], cwd=tmp_path)
        assert found.returncode != 0 and "ModuleNotFoundError" in found.stderr, generic

    refused = run([venv / "bin" / "ttrace", "dashboard", tmp_path], cwd=tmp_path)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.startswith("ttrace: error: the dashboard needs streamlit and plotly") \
        and INSTALL_DASHBOARD in refused.stderr and len(refused.stderr.splitlines()) == 1

    extra = run([venv / "bin" / "python", "-m", "pip", "install", "--no-input", "-c", ROOT / "requirements.txt",
                 f"streamlit=={pinned_version('streamlit')}", f"plotly=={pinned_version('plotly')}"], cwd=tmp_path)
    assert extra.returncode == 0, extra.stderr[-3000:]
    write_pair(tmp_path / "runs")
    render = ("import sys; from streamlit.testing.v1 import AppTest\n"
              "app = AppTest.from_file(sys.argv[1], default_timeout=120).run()\n"
              "assert not app.exception, app.exception\n"
              "print([t.value for t in app.title], [e.value for e in app.error])\n")
    shown = run([venv / "bin" / "python", "-c", render, entrypoint], cwd=tmp_path,
                extra_env={"TTRACE_ROOT": str(tmp_path / "runs")})
    assert shown.returncode == 0, shown.stdout + shown.stderr[-3000:]
    assert "['Runs']" in shown.stdout and "FAILED (not equivalent): first divergence" in shown.stdout, shown.stdout


def test_the_readmes_first_command_installs_the_dashboard_only(venv, tmp_path):
    """The README's first command, as written, in the fresh venv: it installs the dashboard's needs and none of
    the test tooling or the frameworks, and `ttrace dashboard` then serves the URL it prints."""
    import shlex

    first = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("pip install"))
    install, _, serve = first.partition(" && ttrace dashboard ")
    assert serve == "sample_traces", first
    words = shlex.split(install)
    assert words[:2] == ["pip", "install"] and "requirements.txt" in words, install
    source = venv.parent / "ttrace-source"
    done = run([venv / "bin" / "python", "-m", *words, "--no-input"], cwd=source, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    listed = run([venv / "bin" / "python", "-m", "pip", "list", "--format=freeze"], cwd=venv).stdout.lower()
    for wanted in ("streamlit", "plotly", "torch", "h5py"):
        assert re.search(rf"^{wanted}==", listed, flags=re.MULTILINE), wanted
    for unwanted in ("megatron-core", "torchtitan", "transformers", "pytest", "playwright"):
        assert not re.search(rf"^{unwanted}==", listed, flags=re.MULTILINE), unwanted

    write_pair(tmp_path / "runs")
    port = free_port()
    env = {name: value for name, value in os.environ.items() if name not in ("PYTHONPATH", "VIRTUAL_ENV")}
    server = subprocess.Popen([str(venv / "bin" / "ttrace"), "dashboard", "runs", "--port", str(port)], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        printed = server.stdout.readline()
        assert f"http://127.0.0.1:{port}/runs" in printed, printed
        wait_healthy(f"http://127.0.0.1:{port}", server, timeout_s=120)
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)
