"""Matrix products measured on this device: the profile's "products" table (cost_models/compute.py).

Every product of a grid is timed (bf16 on a GPU between CUDA events, the median of 20 after 3 warm-ups; fp32
on a CPU, the fastest of several runs), then ``peak_fraction`` and ``overhead_s`` are fitted to three in four
of them and the fit is judged on the fourth it never saw (issue 26: calibration is reported on held-out
sizes, not on the points it was fitted to), and again leaving each point out in turn.  Ragged grouped
products (``torch._grouped_mm`` over G groups) fit the overhead each further group adds.
"""

from __future__ import annotations

import statistics
import time

import torch

from autotp.cost_models.compute import fit_group_overhead, fit_products, held_out

# (m, n, k): rows by the shapes of transformer layers split 1 to 8 ways; fp32 CPUs get small ones
GPU_GRID = [
    (m, n, k)
    for m in (512, 1024, 2048, 4096, 8192)
    for n, k in (
        (1024, 4096),
        (1792, 4096),
        (3584, 4096),
        (4096, 1024),
        (4096, 1792),
        (4096, 14336),
        (8192, 8192),
        (14336, 4096),
        (28672, 4096),
    )
]
GPU_GROUPED = [(m, 3584, 4096, g) for m in (256, 1024) for g in (2, 4, 8, 16)]
CPU_GRID = [(m, n, k) for m in (16, 64, 256) for n, k in ((64, 256), (256, 64), (256, 256), (512, 128))]
CPU_GROUPED = [(64, 128, 128, g) for g in (2, 4, 8)]


def timed(fn, device) -> float:
    """Seconds of one ``fn()``: on a GPU the median of 20 between CUDA events after 3 warm-ups; on a CPU the
    fastest of 10 (a shared machine only ever adds time)."""
    for _ in range(3):
        fn()
    if torch.device(device).type == "cuda":
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)
    best = float("inf")
    for _ in range(10):
        begin = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - begin)
    return best


def product_seconds(m: int, n: int, k: int, device, dtype, groups: int = 1) -> float:
    """Seconds of [m, k] @ [k, n] (with ``groups``: a grouped product of that many groups of m rows)."""
    if groups == 1:
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        return timed(lambda: a @ b, device)
    x = torch.randn(groups * m, k, device=device, dtype=dtype)
    w = torch.randn(groups, k, n, device=device, dtype=dtype)
    offs = torch.arange(m, groups * m + 1, m, device=device, dtype=torch.int32)
    return timed(lambda: torch._grouped_mm(x, w, offs), device)


def measure_products(device, dtype=None, grid=None, grouped=None, seconds=product_seconds) -> dict:
    """{"plain": [(m, n, k, seconds)], "grouped": [(m, n, k, groups, seconds)]} on ``device`` (``seconds``: the
    timer, replaceable to test the fit)."""
    gpu = torch.device(device).type == "cuda"
    dtype = dtype or (torch.bfloat16 if gpu else torch.float32)
    grid = grid if grid is not None else GPU_GRID if gpu else CPU_GRID
    grouped = grouped if grouped is not None else GPU_GROUPED if gpu else CPU_GROUPED
    return {
        "plain": [(m, n, k, seconds(m, n, k, device, dtype)) for m, n, k in grid],
        "grouped": [(m, n, k, g, seconds(m, n, k, device, dtype, g)) for m, n, k, g in grouped],
        "dtype": str(dtype).removeprefix("torch."),
    }


def product_table(measured: dict, source: str, peak_flops: float | None = None) -> tuple[dict, float]:
    """(the profile's "products" table, peak FLOP/s): fractions of ``peak_flops`` (default: the fastest product
    measured), the fitted figures with their held-out errors in their sources, every point with its source."""
    plain = measured["plain"]
    peak = peak_flops or max(2.0 * m * n * k / t for m, n, k, t in plain)
    points = [(m, n, k, 2.0 * m * n * k / t / peak) for m, n, k, t in plain]
    fitted = fit_products(points, peak)
    quarter, each = held_out(points, peak, every=4), held_out(points, peak, every=len(points))
    errors = (
        f"fitted to {len(points)} products of {measured['dtype']}; on the sizes left out of the fit: every "
        f"fourth held out, median {quarter['median']:.1%}, max {quarter['max']:.1%}; leave-one-out median "
        f"{each['median']:.1%}, max {each['max']:.1%}"
    )
    grouped = [(m, n, k, g, 2.0 * g * m * n * k / t / peak) for m, n, k, g, t in measured["grouped"]]
    group = fit_group_overhead(grouped, fitted, peak) if grouped else fitted["overhead_s"]
    table = {
        "peak_fraction": {"value": fitted["peak_fraction"], "source": f"{source}: {errors}"},
        "overhead_s": {"value": fitted["overhead_s"], "source": f"{source}: {errors}"},
        "group_overhead_s": {
            "value": group,
            "source": f"{source}: fitted to {len(grouped)} grouped products "
            "(torch._grouped_mm) given the plain products' figures",
        },
        "points": [
            {"m": m, "n": n, "k": k, "fraction": f, "source": f"{source}, {measured['dtype']}"} for m, n, k, f in points
        ],
        "held_out": {"every_fourth": quarter["rows"], "leave_one_out": each["rows"]},
    }
    return table, peak
