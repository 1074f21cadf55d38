"""The rank side of recording_overhead.py: one megatron-core GPT (TP over the spawned gloo ranks)
trained step after step, each step in one mode, the modes interleaved round by round so that drift
on a shared machine hits them all alike:

- untraced: no hook at all;
- hooks alone: a forward hook and a full backward hook on every module the tracer would trace, doing
  nothing: what torch's hook machinery costs (a full backward hook wraps each call's inputs and outputs);
- raw hooks: the same hooks, each copying what it sees (`clone`), dropped at the step's end: the floor
  any recording pays;
- full: the Tracer, values and statistics;
- full, writer thread: the same, stored by a writer thread (TracerConfig.writer_queue_bytes = 256 MiB);
- stats-only: the Tracer, statistics only.

Every step's wall and CPU time is the slowest rank's. Rank 0 writes the per-mode step times and trace sizes as JSON.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

MODES = ("untraced", "hooks alone", "raw hooks", "full", "full, writer thread", "stats-only")
WRITER_QUEUE_BYTES = 256 * 2**20


def _raw_hooks(model: torch.nn.Module, tracer_config, copy: bool = True) -> tuple[list, list]:
    """Hooks that copy every traced module's inputs, outputs and gradients (what recording must at least do);
    with `copy` False, the same hooks doing nothing."""
    from ttrace_core.record.tracer import Tracer

    kept, handles = [], []
    probe = Tracer.__new__(Tracer)
    probe.config = tracer_config

    def forward(module, args, output):
        if not copy:
            return
        kept.extend(t.detach().clone() for t in (*args, *(output if isinstance(output, tuple) else (output,)))
                    if isinstance(t, torch.Tensor))

    def backward(module, grad_input, grad_output):
        if not copy:
            return
        kept.extend(t.detach().clone() for t in (*grad_input, *grad_output) if isinstance(t, torch.Tensor))

    for _, module, hooked in Tracer.traced_modules(probe, model):
        handles.append(module.register_forward_hook(forward))
        if hooked:
            handles.append(module.register_full_backward_hook(backward))
    return kept, handles


def _step_fn(config, ddp, optimizer):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ttrace_examples.megatron_gpt.train import forward_step, micro_batch

    forward_backward = get_forward_backward_func()

    def step(recorder=None) -> None:
        batches = [micro_batch(config, index) for index in range(config.num_micro_batches)]
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(forward_step_func=forward_step, data_iterator=iter(batches), model=[ddp],
                         num_microbatches=config.num_micro_batches, seq_length=config.model.seq_len,
                         micro_batch_size=config.micro_batch_size, forward_only=False)
        if recorder is not None:
            recorder.record_gradients()
        optimizer.step()
        if recorder is not None:
            recorder.record_parameters()
    return step


def _timed(step) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one step, each the slowest rank's. CPU time is the process's own (every
    thread, the writer's too): on a machine shared with other work it moves far less than wall time."""
    dist.barrier()
    started, cpu_started = time.perf_counter(), time.process_time()
    step()
    elapsed = torch.tensor([time.perf_counter() - started, time.process_time() - cpu_started])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed[0]), float(elapsed[1])


def _tracer(config, ddp, optimizer, rename, out: Path, mode: str):
    from ttrace_core.integrations.megatron import declare_megatron_run, megatron_manifest, megatron_tracer_config, unwrap
    from ttrace_core.record.tracer import Tracer

    manifest = megatron_manifest(ddp, optimizer, "candidate", dist.get_world_size())
    tracer = Tracer(out, unwrap(ddp), role="candidate", manifest=manifest,
                    config=megatron_tracer_config(loss_scale=1 / config.num_micro_batches, rename=rename,
                                                  stats_only=mode == "stats-only",
                                                  writer_queue_bytes=WRITER_QUEUE_BYTES if "writer thread" in mode else 0))
    declare_megatron_run(tracer, ddp, optimizer)
    return tracer


def _one_step(mode: str, config, ddp, optimizer, rename, out: Path, step_index: int) -> tuple[float, int, int, float]:
    """(wall seconds, trace bytes, raw bytes of the recorded tensors, CPU seconds) of one step in `mode`."""
    from ttrace_core.integrations.megatron import megatron_tracer_config, unwrap

    step = _step_fn(config, ddp, optimizer)
    if mode == "untraced":
        seconds, cpu_seconds = _timed(step)
        return seconds, 0, 0, cpu_seconds
    if mode in ("raw hooks", "hooks alone"):
        kept, handles = _raw_hooks(unwrap(ddp), megatron_tracer_config(), copy=mode == "raw hooks")
        seconds, cpu_seconds = _timed(step)
        raw = sum(t.numel() * t.element_size() for t in kept)
        for handle in handles:
            handle.remove()
        kept.clear()
        return seconds, 0, raw, cpu_seconds
    run_dir = out / f"{mode.replace(', ', '-').replace(' ', '-')}-{step_index}"
    tracer = _tracer(config, ddp, optimizer, rename, run_dir, mode)

    def traced() -> None:
        with tracer.step(0):
            step(tracer)
    seconds, cpu_seconds = _timed(traced)
    tracer.close()
    dist.barrier()
    size = sum(p.stat().st_size for p in run_dir.glob(f"rank_{dist.get_rank():05d}.*.h5"))  # this rank's own files
    raw = tracer.num_bytes_recorded  # duplicates counted again: the trace stores them once, as links
    totals = torch.tensor([size, raw], dtype=torch.float64)
    dist.all_reduce(totals)
    if dist.get_rank() == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
    return seconds, int(totals[0]), int(totals[1]), cpu_seconds


def measure(config_dict: dict) -> None:
    from ttrace_examples.megatron_gpt.train import MegatronGPTRunConfig, _build
    from ttrace_core.integrations import megatron_cpu

    config = MegatronGPTRunConfig.from_dict(config_dict["run"])
    out, rounds = Path(config_dict["out"]), config_dict["rounds"]
    megatron_cpu.enable()
    dist.init_process_group("gloo")
    try:
        ddp, optimizer, rename = _build(config)
        _step_fn(config, ddp, optimizer)()  # warm-up: first-call costs are nobody's
        results = {mode: [] for mode in MODES}
        for index in range(rounds):
            for mode in MODES:
                results[mode].append(_one_step(mode, config, ddp, optimizer, rename, out, index))
        profiles = {mode: _profiled(mode, config, ddp, optimizer, rename, out) for mode in ("full", "stats-only")}
        per_call = {mode: _per_call(mode, config, ddp, optimizer, rename, out) for mode in ("full", "stats-only")}
        for mode in ("full", "stats-only"):
            per_call[mode]["replayed"] = _replayed(mode, config, ddp, optimizer, rename, out)
        if dist.get_rank() == 0:
            (out / "overhead.json").write_text(json.dumps({"steps": results, "profiles": profiles, "per_call": per_call}))
        dist.barrier()
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


PROFILED = {
    # what a step's extra time goes to -> the (file path's end, function) whose cumulative time measures it
    "all tracer hooks (Tracer.record)": ("record/tracer.py", "record"),
    "statistics (stats_from_tensor)": ("format/writer.py", "stats_from_tensor"),
    "HDF5 dataset writes (_write_dataset)": ("format/writer.py", "_write_dataset"),
    "tensor to array (array_from_tensor)": ("format/writer.py", "array_from_tensor"),
    "metadata JSON (_meta_to_json)": ("format/writer.py", "_meta_to_json"),
    "room check (_check_room)": ("format/writer.py", "_check_room"),
    "layout resolution (Tracer.layout_of)": (("record/tracer.py", "layout_of"), ("record/layouts.py", "plain_layout")),
    "declared layouts (Declarations.layout)": ("record/declarations.py", "layout"),
    "metadata records (TensorMeta/TensorKey/Layout init)": ("<string>", "__init__"),
    "step file close and rename (RunWriter.end_step)": ("format/writer.py", "end_step"),
}


def _duplicates_tally():
    """Wrap Tracer.record to count the bytes of tensors recorded again within a step: `same object`, the
    very tensor already recorded, alive and unchanged (version counter); `same storage`, the same bytes
    viewed again by another tensor object, its first recorder still alive. Returns (tally, undo)."""
    import weakref

    from ttrace_core.integrations.dtensor import local_value
    from ttrace_core.record.tracer import Tracer

    original, tally, seen = Tracer.record, {"recorded": 0, "same object": 0, "same storage": 0}, {}

    def record(self, key, value, **options):
        local = local_value(value)
        size = local.numel() * local.element_size()
        signature = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape),
                     tuple(local.stride()), local.dtype, local._version, key.step)
        earlier = seen.get(signature)
        owner = earlier() if earlier is not None else None
        tally["recorded"] += size
        if owner is not None:
            tally["same storage"] += size
            tally["same object"] += size if owner is value else 0
        else:
            seen[signature] = weakref.ref(value)
        return original(self, key, value, **options)

    Tracer.record = record

    def undo() -> None:
        Tracer.record = original
    return tally, undo


def _profiled(mode: str, config, ddp, optimizer, rename, out: Path) -> dict:
    """One step of `mode` under cProfile on every rank; rank 0's cumulative seconds per PROFILED entry,
    and (full mode) the share of recorded bytes that were the same tensor recorded again."""
    import cProfile
    import pstats

    tally, undo = _duplicates_tally()
    profile = cProfile.Profile()
    profile.enable()
    try:
        seconds, _, _, _ = _one_step(mode, config, ddp, optimizer, rename, out, 1000)
    finally:
        profile.disable()
        undo()
    stats = pstats.Stats(profile).stats
    found = {"step (profiled)": seconds}
    for name, where in PROFILED.items():
        places = where if isinstance(where[0], tuple) else (where,)  # (file, function) or several of them
        found[name] = sum(entry[3] for (path, _, func), entry in stats.items()
                          if any(path.endswith(file) and func == function for file, function in places))
    found["calls of Tracer.record"] = sum(entry[1] for (path, _, func), entry in stats.items()
                                          if path.endswith("record/tracer.py") and func == "record")
    found["bytes recorded again: same object, unchanged"] = tally["same object"] / max(1, tally["recorded"])
    found["bytes recorded again: same storage"] = tally["same storage"] / max(1, tally["recorded"])
    return found


PER_CALL_STEPS = 3


def _per_call(mode: str, config, ddp, optimizer, rename, out: Path) -> dict:
    """PER_CALL_STEPS steps of `mode` with a timer on each part of the tracer's work (call_costs.py), every
    rank alike; rank 0's own seconds per part (the median over the steps) and calls."""
    from call_costs import Timers, breakdown, instrument, median_breakdown

    found = []
    for index in range(PER_CALL_STEPS):
        timers = Timers()
        undo = instrument(timers)
        try:
            seconds, _, raw, _ = _one_step(mode, config, ddp, optimizer, rename, out, 2000 + index)
        finally:
            undo()
        found.append(breakdown(timers, seconds, raw))
    return median_breakdown(found)


REPLAYS = 5
STATISTICS_PLACES = (("ttrace_core.record.tracer", "stats_from_tensor"), ("ttrace_core.record.summaries:StepSummaries", "stats"))
"""Where the tracer takes a tensor's statistics (before and after issue 43's summaries.py): stubbed for a replay."""


def _replayed(mode: str, config, ddp, optimizer, rename, out: Path) -> dict:
    """The record path alone, without hooks, timers or the model: one step's `Tracer.record` calls captured
    (this rank's), then replayed REPLAYS times into a fresh tracer, in CPU time; and again with the statistics
    stubbed (a constant), which leaves the tracer's Python and the writes. Seconds per call, the least of the
    replays; rank 0's."""
    import importlib

    from ttrace_core.format.schema import TensorStats
    from ttrace_core.record.tracer import Tracer

    calls, original = [], Tracer.record

    def capture(self, key, value, **options):
        calls.append((key, value, options))
        return original(self, key, value, **options)
    Tracer.record = capture
    try:
        _one_step(mode, config, ddp, optimizer, rename, out, 3000)
    finally:
        Tracer.record = original
    constant = TensorStats(numel=1, sum=0.0, sumsq=0.0, min=0.0, max=0.0, num_nan=0, num_inf=0)
    found = {}
    for variant in ("as recorded", "statistics stubbed"):
        undo = []
        if variant == "statistics stubbed":
            for place, name in STATISTICS_PLACES:
                module_name, _, class_name = place.partition(":")
                try:
                    owner = importlib.import_module(module_name)
                except ImportError:
                    continue
                owner = getattr(owner, class_name, None) if class_name else owner
                if owner is not None and name in vars(owner):
                    undo.append((owner, name, vars(owner)[name]))
                    setattr(owner, name, (lambda *args, **kwargs: constant))
        seconds = []
        try:
            for index in range(REPLAYS):
                run_dir = out / f"replay-{mode.replace(' ', '-')}-{variant.replace(' ', '-')}-{index}"
                tracer = _tracer(config, ddp, optimizer, rename, run_dir, mode)
                with tracer.step(0, parameters_before=False):  # the captured calls hold the step's first values
                    started = time.process_time()
                    for key, value, options in calls:
                        tracer.record(key, value, **options)
                    seconds.append(time.process_time() - started)
                tracer.close()
                dist.barrier()  # the ranks share the run directory
                if dist.get_rank() == 0:
                    shutil.rmtree(run_dir, ignore_errors=True)
        finally:
            for owner, name, kept in undo:
                setattr(owner, name, kept)
        found[variant] = min(seconds) / max(1, len(calls))
    return found
