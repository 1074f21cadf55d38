"""Launch a bundled example: as a command (`python -m ttrace_examples`) or recorded by `ttrace example`.

Either way the ranks call `ttrace_core.attach`, and the run's manifest names the command
`python -m ttrace_examples WORKLOAD --config JSON`, which `ttrace estimate` / `ttrace localize`
relaunch like any user's script.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

from ttrace_core.errors import TtraceError
from ttrace_core.record.launch import ONE_RANK_PORT, resolve, run_ranks, under_torchrun

WORKLOADS = {"torch-gpt": "ttrace_examples.torch_gpt.train", "megatron-gpt": "ttrace_examples.megatron_gpt.train",
             "hf-llama": "ttrace_examples.hf_llama.train"}
CONFIG_CLASSES = {"torch-gpt": "TorchGPTRunConfig", "megatron-gpt": "MegatronGPTRunConfig",
                  "hf-llama": "MegatronGPTRunConfig"}
"""hf-llama takes the megatron-gpt candidate's own config: it is that run's reference in another implementation."""


def run_config(workload: str, config: dict):
    """The example's RunConfig from JSON-able fields (validated by its __post_init__)."""
    module = importlib.import_module(WORKLOADS[workload])
    return getattr(module, CONFIG_CLASSES[workload]).from_dict(config)


def example_command(workload: str, config, timeout_s: float) -> list[str]:
    return [sys.executable, "-m", "ttrace_examples", workload, "--config", json.dumps(config.to_dict()),
            "--timeout", str(timeout_s)]


def launch(workload: str, config, *, timeout_s: float, env: dict[str, str] | None = None) -> None:
    """Run the example's ranks: spawned gloo ranks (with `env` added to theirs), or this process alone for
    one rank (megatron still gets a one-rank process group), or as-is under torchrun."""
    entrypoint = f"{WORKLOADS[workload]}:run"
    if config.world_size == 1 and not under_torchrun() and env is None:
        # This process is the example's own command: its environment is its to set.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT") or ONE_RANK_PORT)
        resolve(entrypoint)(config.to_dict())
    else:
        run_ranks(entrypoint, config.to_dict(), config.world_size, timeout_s=timeout_s, env=env)


def record_example(out: str | os.PathLike, workload: str, config, *, timeout_s: float) -> Path:
    """`ttrace example`: `ttrace record` of the example's command, its ranks started from this process in the
    session (forked from it when it runs one thread: record/launch.py) instead of running the command, which
    would import torch and the model's framework again."""
    from ttrace_core.record.command import session_environment
    from ttrace_core.record.session import SESSION_ENV, SessionSpec
    from ttrace_core.format.writer import refuse_existing_trace

    out = Path(out).resolve()
    refuse_existing_trace(out)
    spec = SessionSpec(out=str(out), launcher_pid=os.getpid(), command=example_command(workload, config, timeout_s),
                       cwd=os.getcwd(), seed=config.seed, stats_only=config.stats_only)
    with session_environment(spec) as env:
        launch(workload, config, timeout_s=timeout_s, env={SESSION_ENV: env[SESSION_ENV]})
    if not (out / "manifest.json").is_file():
        raise TtraceError(f"{workload} finished but recorded nothing into {out}")
    return out
