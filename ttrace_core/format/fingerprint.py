"""The environment a run was recorded in, so that a replay can say why it does not reproduce it.

`environment_fingerprint()` is stored in every manifest (`environment`); a replay compares its own
with the candidate's (`fingerprint_differences`) and prints the differences when the un-rewritten
candidate's tensors are not reproduced.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version

PACKAGES = ("ttrace", "torch", "numpy", "megatron-core", "transformer-engine", "h5py")
DISTRIBUTIONS = {"ttrace": "ttrace-dist"}
"""A package whose distribution has another name: ttrace is installed as ttrace-dist (`ttrace` on the package
index is an unrelated project). ttrace_core.DISTRIBUTION names it; stage 0 imports nothing above it, so it is
written here again, and tests/core/format/test_fingerprint.py checks that the two agree."""
# Variables that change what a CPU training step computes or how it is laid out.
VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE", "CUBLAS_WORKSPACE_CONFIG",
             "NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "PYTHONHASHSEED")


def installed_version(package: str) -> str | None:
    """The installed version of one of PACKAGES (None: not installed as a distribution)."""
    try:
        return version(DISTRIBUTIONS.get(package, package))
    except PackageNotFoundError:
        return None


def environment_fingerprint(world_size: int | None = None) -> dict:
    return {
        "command": list(sys.argv),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {name: installed_version(name) for name in PACKAGES},
        "variables": {name: os.environ.get(name) for name in VARIABLES},
        "world_size": world_size,
    }


def fingerprint_differences(recorded: dict, current: dict) -> list[str]:
    """"what: recorded -> now" for every field that differs (the command and ttrace's own variables
    differ in every replay by design, so they are left out)."""
    if not recorded:
        return ["the candidate's manifest has no environment fingerprint (recorded by an older ttrace)"]
    differences = []
    for group in ("packages", "variables"):
        for name in sorted(set(recorded.get(group, {})) | set(current.get(group, {}))):
            if name.startswith("TTRACE_"):
                continue
            before, now = recorded.get(group, {}).get(name), current.get(group, {}).get(name)
            if before != now:
                differences.append(f"{name}: {before} -> {now}")
    for name in ("python", "platform", "world_size"):
        if recorded.get(name) != current.get(name):
            differences.append(f"{name}: {recorded.get(name)} -> {current.get(name)}")
    return differences
