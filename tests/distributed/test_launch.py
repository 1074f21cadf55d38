import os

import pytest

from ttrace_core.errors import LaunchError
from ttrace_core.record.launch import free_port, run_ranks

pytestmark = pytest.mark.distributed


def test_a_failing_rank_stops_the_others_at_once():
    """Rank 1 waits in a collective that never completes: a launcher that waited for it would raise
    "timed out after 120 s" instead, so the message is the check (no wall-clock bound)."""
    with pytest.raises(LaunchError, match="^rank 0 exited with code 1; the other ranks were stopped") as raised:
        run_ranks("tests.distributed.workers:fail_on_rank_0", {}, 2, timeout_s=120)
    assert not raised.value.killed_by_signal


def test_a_rank_killed_from_outside_is_named_by_its_signal():
    with pytest.raises(LaunchError, match="^rank 1 was killed by SIGKILL; the other ranks were stopped") as raised:
        run_ranks("tests.distributed.workers:sigkill_rank_1", {}, 2, timeout_s=120)
    assert raised.value.killed_by_signal


def test_a_rank_still_running_after_another_failed_is_stopped_by_sigterm_and_says_so(capfd):
    """SIGTERM, not SIGKILL, first: the survivor unwinds, so its tracer can say why its step stopped.
    Rank 1 would sleep 600 s: not stopped, the launcher would raise at its 120 s timeout instead."""
    with pytest.raises(LaunchError, match="^rank 0 exited with code 1; the other ranks were stopped"):
        run_ranks("tests.distributed.workers:fail_on_rank_0_while_rank_1_sleeps", {}, 2, timeout_s=120)
    assert "rank 1: stopped by the launcher (SIGTERM) after another rank failed" in capfd.readouterr().out


def test_a_hang_is_killed_at_the_timeout_with_stacks(capfd):
    with pytest.raises(LaunchError, match="timed out after 3 s"):
        run_ranks("tests.distributed.workers:hang_on_rank_1", {}, 2, timeout_s=3)
    assert "rank 1" in capfd.readouterr().out


def test_free_port_is_bindable():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))


def test_a_rendezvous_port_taken_before_rank_0_listens_is_retried_on_a_new_port(tmp_path, capfd):
    """free_port releases the port it found; another process can bind it before rank 0's store does
    (seen as EADDRINUSE under load): the launcher starts the ranks again on a new port, once said."""
    run_ranks("tests.distributed.workers:port_taken_on_the_first_attempt", {"marker": str(tmp_path / "marker")}, 2,
              timeout_s=120)
    out = capfd.readouterr().out
    assert "was taken by another process; starting the 2 ranks again on a new port (attempt 2 of 3)" in out


@pytest.mark.parametrize("a_thread_runs", [False, True])
def test_ranks_see_the_launchers_environment_and_streams_as_they_are_now(capfd, monkeypatch, a_thread_runs):
    """The fork server (used when the launcher runs another thread) starts at the first launch, with that
    moment's environment and standard streams; a later launch's ranks must still see the variables set since and
    write where the launcher's output goes now (pytest points it at a new capture for every test). Ranks forked
    by the launcher itself must keep its streams open."""
    import threading

    stop = threading.Event()
    if a_thread_runs:
        threading.Thread(target=stop.wait, daemon=True).start()
    monkeypatch.setattr("ttrace_core.record.launch._one_thread", lambda: not a_thread_runs)
    for value in ("first", "second"):
        monkeypatch.setenv("TTRACE_LAUNCH_PROBE", value)
        run_ranks("tests.distributed.workers:say_where_it_runs", {"name": "TTRACE_LAUNCH_PROBE"},
                  2, timeout_s=120)
        out = capfd.readouterr().out
        assert f"rank 0: TTRACE_LAUNCH_PROBE={value};" in out and f"rank 1: TTRACE_LAUNCH_PROBE={value};" in out, out
    print("the launcher's stdout is still open", flush=True)
    assert "still open" in capfd.readouterr().out
    stop.set()


def test_one_rank_groups_started_at_once_never_share_a_port():
    """ONE_RANK_PORT: each one-rank group's store listens on a port the system picks as it binds. Two groups
    holding the same port would be EADDRINUSE, which a port found before listening (free_port) cannot rule
    out while other processes open connections (it failed a CI run so)."""
    import os
    import subprocess
    import sys

    from ttrace_core.record.launch import ONE_RANK_PORT

    hold = ("import sys, torch.distributed as dist; dist.init_process_group('gloo'); "
            "store = dist.distributed_c10d._get_default_store()\n"
            "while hasattr(store, 'underlying_store'): store = store.underlying_store  # (prefixes)\n"
            "print(store.port, flush=True); sys.stdin.read()")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": ONE_RANK_PORT,
           "OMP_NUM_THREADS": "1"}
    groups = [subprocess.Popen([sys.executable, "-c", hold], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env=env) for _ in range(2)]
    try:
        ports = [int(group.stdout.readline()) for group in groups]  # each is listening once it prints
    finally:
        for group in groups:
            group.communicate("", timeout=60)
    assert all(group.returncode == 0 for group in groups) and ports[0] != ports[1] and 0 not in ports


@pytest.mark.parametrize("threads", [1, 2])
def test_ranks_start_with_torchs_compiler_front_end_and_their_declared_imports_imported_once(threads):
    """torch._dynamo (every optimizer's constructor imports it, about 1 s of CPU) and the target module's
    RANK_IMPORTS (megatron-core for the megatron example, about 3 s) are imported once, not again by each rank. A
    launcher running one thread forks its ranks from itself; one running another thread (here a waiting one) forks
    them from a fresh fork server. In a new process: this one's server may have started before torch was imported."""
    import subprocess
    import sys

    from tests.support.paths import REPO

    probe = ("import os, threading, torch\nfrom ttrace_core.record.launch import run_ranks\n"
             f"if {threads} == 2: threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
             "print('launcher', os.getpid(), flush=True)\n"
             "run_ranks('tests.distributed.workers:say_where_it_runs', {'name': 'RANK'}, 2, timeout_s=120)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("torch._dynamo preloaded: True; rank imports preloaded: True") == 2, done.stdout
    launcher = done.stdout.split()[1]
    forked_by_launcher = done.stdout.count(f"parent {launcher}\n")
    assert forked_by_launcher == (2 if threads == 1 else 0), done.stdout
