"""ttrace: find and localize silent bugs in distributed training by differential tensor tracing.

In a training script: `session = ttrace_core.attach(model, optimizer)`, then `with session.step(i):`
around each iteration; it records only when the script runs under `ttrace record`.

The stages are packages, each importing only those before it (docs/architecture.md):
format -> canonicalize -> integrations -> record | compare -> localize -> workflows -> service -> api -> cli.
The names below are loaded on first use, so `import ttrace_core` (or `ttrace_core.api`) loads no torch
and changes no process-wide state. This package never imports streamlit, plotly or the dashboard.
"""

from __future__ import annotations

import importlib

# The distribution's name on the package index (`ttrace` there is someone else's): what `pip install` and
# importlib.metadata know this project by. The command stays `ttrace`, the imports `ttrace_core`.
DISTRIBUTION = "ttrace-dist"
INSTALL_DASHBOARD = f"pip install '{DISTRIBUTION}[dashboard]' -c requirements.txt"

_EXPORTS = {
    "attach": "ttrace_core.record.session", "Session": "ttrace_core.record.session",
    "attach_trainer": "ttrace_core.record.trainer_attach",
    "weight_perturbation": "ttrace_core.record.session", "requested_precision": "ttrace_core.record.session",
    "Tracer": "ttrace_core.record.tracer", "TracerConfig": "ttrace_core.format.tracer_config",
    "CanonicalTensor": "ttrace_core.canonicalize.shards", "RecordedShard": "ttrace_core.canonicalize.shards",
    "shard": "ttrace_core.canonicalize.shards",
    "compare_runs": "ttrace_core.compare.engine", "RunComparison": "ttrace_core.compare.results",
    "TensorComparison": "ttrace_core.compare.results", "Tolerance": "ttrace_core.compare.results",
    "DtypeTolerances": "ttrace_core.compare.tolerances", "ToleranceProvider": "ttrace_core.compare.tolerances",
    "CompareSettings": "ttrace_core.compare.settings",
    "ConfigMismatchError": "ttrace_core.errors", "LayoutError": "ttrace_core.errors",
    "TraceFormatError": "ttrace_core.errors", "TtraceError": "ttrace_core.errors",
    "Layout": "ttrace_core.format.schema", "RunManifest": "ttrace_core.format.schema",
    "TensorKey": "ttrace_core.format.schema", "TensorMeta": "ttrace_core.format.schema",
    "RunReader": "ttrace_core.format.reader",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ttrace_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
