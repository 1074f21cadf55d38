"""The rank side of recording_overhead.py's per-call breakdown: recorded steps with a wall-clock timer
around each part of the tracer's work per tensor, no profiler.

Each part is a set of functions (COST_PARTS); a timer wraps each of them for one step and keeps its own time,
its callees' timed time taken out, so the parts add up to the time spent in the tracer's hooks. Divided by
the step's `Tracer.record` calls (one per recorded tensor), that is microseconds per tensor; divided by
the module hook calls, per hook call. A timed call adds about `timer_us` (measured in the same process,
reported) to its caller's own time: the breakdown is a little slower than the untimed step it explains.
"""

from __future__ import annotations

import importlib
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable

COST_PARTS: dict[str, tuple[tuple[str, str], ...]] = {
    # part -> (module or module:Class, function) of every function whose own time counts for it
    "module hooks, own code (argument walks, clocks)": (("ttrace_core.record.module_hooks:ModuleHooks", "_hook_calls"),),
    "Tracer.record, own code (checks, local value, bookkeeping)": (
        ("ttrace_core.record.tracer:Tracer", "record"), ("ttrace_core.record.tracer:Tracer", "_record")),
    "layout resolution": (("ttrace_core.record.tracer", "plain_layout"), ("ttrace_core.record.tracer:Tracer", "_dtensor_layout")),
    "statistics": (("ttrace_core.record.tracer", "stats_from_tensor"), ("ttrace_core.record.summaries", "stats_from_tensor"),
                   ("ttrace_core.record.summaries:StepSummaries", "stats")),
    "key and metadata records": (("ttrace_core.record.tracer:Tracer", "key"), ("ttrace_core.record.tracer", "TensorMeta")),
    "same-storage check (dedupe)": (("ttrace_core.format.same_storage:WrittenStorages", "first_dataset"),
                                    ("ttrace_core.format.same_storage:WrittenStorages", "remember")),
    "index row (JSON)": (("ttrace_core.format.writer", "row_line"),),
    "writer, own code": (("ttrace_core.format.writer:RunWriter", "write"), ("ttrace_core.format.writer:RunWriter", "write_link")),
    "HDF5 write (array, room check, dataset or link)": (
        ("ttrace_core.format.writer", "array_from_tensor"), ("ttrace_core.format.writer:RunWriter", "_check_room"),
        ("ttrace_core.format.writer", "_write_dataset"), ("ttrace_core.format.writer", "_write_hard_link")),
}
"""The module hooks are timed through what wraps them (`_hook_calls`, below): each hook closure is made at attach."""
RECORD_CALLS = "ttrace_core.record.tracer:Tracer.record"
"""The calls counted as tensors: one `Tracer.record` per recorded tensor (a routed expert's pieces are one call)."""


class Timers:
    """Own wall time and calls per part; a timed call inside another counts for its own part only."""

    def __init__(self) -> None:
        self.own_s: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self._children: list[float] = []

    def wrap(self, part: str, function: Callable, name: str = "") -> Callable:
        """`function` timed for `part`; its calls are also counted under `name` when given."""
        own_s, calls, children, clock = self.own_s, self.calls, self._children, time.perf_counter

        def timed(*args, **kwargs):
            children.append(0.0)
            started = clock()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = clock() - started
                own_s[part] += elapsed - children.pop()
                calls[part] += 1
                if name:
                    calls[name] += 1
                if children:
                    children[-1] += elapsed
        return timed


def _owner(place: str):
    module_name, _, class_name = place.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, class_name) if class_name else module


def instrument(timers: Timers) -> Callable[[], None]:
    """Wrap every COST_PARTS function (and each module hook as it is attached); returns the undo. A function
    this version of ttrace does not have is skipped (the table lists the places of every version measured)."""
    from ttrace_core.record.module_hooks import ModuleHooks

    undo = []
    for part, places in COST_PARTS.items():
        for place, name in places:
            if name == "_hook_calls":
                continue
            try:
                owner = _owner(place)
            except (ImportError, AttributeError):
                continue
            original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
            if original is None:
                continue
            qualified = f"{place}.{name}"
            if isinstance(original, staticmethod):
                wrapped = staticmethod(timers.wrap(part, original.__func__, qualified))
            else:
                wrapped = timers.wrap(part, original, qualified)
            setattr(owner, name, wrapped)
            undo.append((owner, name, original))
    hook_part = next(part for part, places in COST_PARTS.items() if places[0][1] == "_hook_calls")
    guarded = ModuleHooks.guarded
    ModuleHooks.guarded = lambda self, fqn, hook: timers.wrap(hook_part, guarded(self, fqn, hook))
    undo.append((ModuleHooks, "guarded", guarded))

    def restore() -> None:
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)
    return restore


def timer_cost_us(timers_count: int = 20000) -> float:
    """What one timed call adds to its caller's time, in microseconds (a timed no-op against a bare one)."""
    probe = Timers()
    noop = lambda: None  # noqa: E731
    timed = probe.wrap("probe", noop)
    started = time.perf_counter()
    for _ in range(timers_count):
        noop()
    bare = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(timers_count):
        timed()
    return 1e6 * max(time.perf_counter() - started - bare, 0.0) / timers_count


def breakdown(timers: Timers, step_s: float, recorded_bytes: int) -> dict:
    """The step's parts as JSON: own seconds and calls per part, Tracer.record calls (tensors), hook calls."""
    return {"step_s": step_s, "timer_us": timer_cost_us(), "recorded_bytes": recorded_bytes,
            "record_calls": timers.calls[RECORD_CALLS], "hook_calls": timers.calls[next(iter(COST_PARTS))],
            "function_calls": {name: count for name, count in timers.calls.items() if name not in COST_PARTS},
            "parts": {part: {"own_s": timers.own_s[part], "calls": timers.calls[part]} for part in COST_PARTS}}


def median_breakdown(found: list[dict]) -> dict:
    """Several steps' breakdowns as one: each part's median own time, the step's median time (a step on a
    shared machine may be slowed as a whole; the median part is the typical one)."""
    merged = {**found[0], "steps": len(found), "step_s": statistics.median(b["step_s"] for b in found)}
    merged["parts"] = {part: {"own_s": statistics.median(b["parts"][part]["own_s"] for b in found),
                              "calls": found[0]["parts"][part]["calls"]} for part in found[0]["parts"]}
    return merged
