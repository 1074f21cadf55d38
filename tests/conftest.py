import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MEGATRON_SIZE = ("--num-layers", "2")
"""Megatron tests run a 2-layer GPT: every layout still has one layer per pipeline stage."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that spawns gloo ranks (`distributed`) or installs ttrace (`slow_install`) is slow too, so
    `-m "not slow"` leaves it out; tryfirst: before `-m` deselects."""
    for item in items:
        if item.get_closest_marker("distributed") or item.get_closest_marker("slow_install"):
            item.add_marker(pytest.mark.slow)


def run_ttrace(*args: str, timeout: float = 300, check_codes: tuple[int, ...] | None = None) -> subprocess.CompletedProcess:
    """Run the `ttrace` CLI as a user would (forked from the tests' warm worker: tests/support/warm_cli.py)."""
    from tests.support import warm_cli

    result = warm_cli.run(*args, cwd=ROOT, timeout=timeout)
    if check_codes is not None and result.returncode not in check_codes:
        raise AssertionError(f"ttrace {' '.join(args)} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def load_comparison(path: Path):
    from ttrace_core.compare.engine import RunComparison

    return RunComparison.from_json(path.read_text())


@pytest.fixture(scope="session")
def robustness_base(tmp_path_factory, worker_id) -> tuple[Path, Path]:
    """The robustness benchmark's own base (tests/faults/damage_runner.py): a 1-layer megatron-core pair, a
    1-rank reference with its tolerance estimate and a TP2 + SP candidate with a finished replay job
    (about 30 s), small enough to damage a few hundred copies of in CI. Recorded once per test run, not once
    per xdist worker: the workers share this run's base temporary directory, and the first one to take the
    lock records it (tests only damage copies of it)."""
    import fcntl

    from tests.faults.damage_runner import record_base

    shared = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    with open(shared / "robustness-base.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return record_base(shared / "robustness-base")


@pytest.fixture(scope="session")
def traces(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("traces")


@pytest.fixture(scope="session")
def reference_run(traces) -> Path:
    out = traces / "reference"
    run_ttrace("example", "torch-gpt", "--steps", "2", "--out", str(out), check_codes=(0,))
    return out


@pytest.fixture(scope="session")
def megatron_reference(traces) -> Path:
    out = traces / "megatron-reference"
    run_ttrace("example", "megatron-gpt", *MEGATRON_SIZE, "--steps", "2", "--out", str(out), check_codes=(0,))
    return out


@pytest.fixture(scope="session")
def megatron_moe_reference(traces) -> Path:
    out = traces / "megatron-moe-reference"
    run_ttrace("example", "megatron-gpt", *MEGATRON_SIZE, "--moe", "--steps", "1", "--out", str(out), check_codes=(0,))
    return out
