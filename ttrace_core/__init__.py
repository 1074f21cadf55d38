"""ttrace: find and localize silent bugs in distributed training by differential tensor tracing.

In a training script: `session = ttrace_core.attach(model, optimizer)`, then `with session.step(i):`
around each iteration; it records only when the script runs under `ttrace record`.
Pipeline: record (Tracer) -> canonicalize -> compare (compare_runs) -> localize -> render.
This package never imports streamlit or plotly.
"""

from ttrace_core.canonicalize import CanonicalTensor, RecordedShard, canonicalize, shard
from ttrace_core.compare import RunComparison, TensorComparison, compare_runs
from ttrace_core.errors import ConfigMismatchError, LayoutError, TraceFormatError, TtraceError
from ttrace_core.session import Session, attach, weight_perturbation
from ttrace_core.schema import Layout, RunManifest, TensorKey, TensorMeta
from ttrace_core.store import RunReader
from ttrace_core.tolerances import DtypeTolerances, Tolerance, ToleranceProvider
from ttrace_core.tracer import Tracer, TracerConfig

__all__ = [
    "CanonicalTensor", "ConfigMismatchError", "DtypeTolerances", "Layout", "LayoutError", "RecordedShard",
    "RunComparison", "RunManifest", "RunReader", "TensorComparison", "TensorKey", "TensorMeta", "Tolerance",
    "Session", "ToleranceProvider", "TraceFormatError", "Tracer", "TracerConfig", "TtraceError", "attach", "canonicalize", "weight_perturbation",
    "compare_runs", "shard",
]
