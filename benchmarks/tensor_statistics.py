"""Cost of one recorded tensor's statistics (format/writer.py `stats_from_tensor`) against the version
before issue 29's rework (copied in below as `stats_before`), on CPU, for the activation sizes of the
recording_overhead.py testbed and larger, contiguous and transposed, fp32 and bf16. Both run in the same
process, interleaved round by round; the figure is the median time per call and the ratio new / before.
It also checks that both give the same statistics. Writes results/tensor_statistics.{md,json}.

    OMP_NUM_THREADS=1 python benchmarks/tensor_statistics.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from ttrace_core.format.schema import TensorStats
from ttrace_core.format.writer import stats_from_tensor

RESULTS = Path(__file__).parent / "results"
SIZES = (4096, 65536, 262144, 1048576)


def stats_before(value: torch.Tensor) -> TensorStats:
    """stats_from_tensor as of commit 3de4ce1: sum, aminmax (amin/amax apart over a strided tensor), norm."""
    numel = value.numel()
    if numel == 0 or not value.is_floating_point():
        return TensorStats(numel=numel, sum=0.0, sumsq=0.0, min=0.0, max=0.0, num_nan=0, num_inf=0)
    as_float = value.detach() if value.dtype in (torch.float32, torch.float64) else value.detach().float()
    total = float(as_float.sum())
    if not math.isfinite(total):
        num_nan, num_inf = int(torch.isnan(as_float).sum()), int(torch.isinf(as_float).sum())
        as_float = as_float[torch.isfinite(as_float)].double()
        total = float(as_float.sum())
    else:
        num_nan = num_inf = 0
    minimum, maximum = torch.aminmax(as_float) if as_float.is_contiguous() else (as_float.amin(), as_float.amax())
    sumsq = float(torch.linalg.vector_norm(as_float)) ** 2
    if not math.isfinite(sumsq):
        sumsq = float(torch.linalg.vector_norm(as_float.double())) ** 2
    return TensorStats(numel=numel, sum=total, sumsq=sumsq, min=float(minimum), max=float(maximum),
                       num_nan=num_nan, num_inf=num_inf)


def cases() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    found = {}
    for size in SIZES:
        square = torch.randn(size // 256, 256, generator=generator)
        found[f"fp32 {size}"] = square
        found[f"fp32 {size} transposed"] = square.t()
        found[f"bf16 {size}"] = square.bfloat16()
    with_nan = torch.randn(65536, generator=generator)
    with_nan[::97] = float("nan")
    found["fp32 65536 with NaN"] = with_nan
    return found


def seconds_per_call(function, value: torch.Tensor, repeats: int) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        function(value)
    return (time.perf_counter() - started) / repeats


def measure(rounds: int) -> list[dict]:
    rows = []
    for name, value in cases().items():
        assert stats_from_tensor(value) == stats_before(value), f"{name}: statistics differ"
        repeats = max(10, 2_000_000 // value.numel())
        timed = {"before": [], "now": []}
        for _ in range(rounds):
            timed["before"].append(seconds_per_call(stats_before, value, repeats))
            timed["now"].append(seconds_per_call(stats_from_tensor, value, repeats))
        before, now = statistics.median(timed["before"]), statistics.median(timed["now"])
        rows.append({"case": name, "before_us": 1e6 * before, "now_us": 1e6 * now, "ratio": now / before,
                     "identical": True})
    return rows


def render(rows: list[dict], setup: str) -> str:
    lines = [f"# Tensor statistics: stats_from_tensor now against before ({setup})", "",
             "Same values in every case (checked: equal TensorStats).", "",
             "| tensor | before (us/call) | now (us/call) | now / before |", "| --- | --- | --- | --- |"]
    for row in rows:
        lines.append(f"| {row['case']} | {row['before_us']:.1f} | {row['now_us']:.1f} | {row['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    setup = (f"torch {torch.__version__} CPU, {torch.get_num_threads()} thread(s); median of {args.rounds} "
             "interleaved rounds")
    rows = measure(args.rounds)
    text = render(rows, setup)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "tensor_statistics.md").write_text(text)
    (args.results / "tensor_statistics.json").write_text(json.dumps({"setup": setup, "rows": rows}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
