"""Time of one op on one device.

A matrix product is priced by its shape: ``F / (peak_fraction x peak) + overhead`` per kernel, never faster
than moving its bytes.  Thin products run far below peak (one kernel's fixed cost and its last wave of tiles
weigh more the fewer FLOPs it has), so the fraction of peak a product reaches, F / (peak x time), grows with
its FLOPs towards ``peak_fraction``.  The two figures are fitted (``fit_products``) to the device's table of
measured products (topologies/*.json "products", each point with its source; ``autotp calibrate`` measures
one).  A ragged grouped product (tokens sorted by expert, one kernel over the experts' groups) pays the
overhead again for each further group, as separate products would, but never more than that group's own time
(the waste is its last partial wave of tiles): tiny groups cost one launch.  Other ops: the memory roofline.

A product of weights stored quantized is priced as a fused kernel runs it: it reads the stored bytes (FP8 one a
weight, int4 half), so a decode product's weight reads halve against bf16, and it dequantizes each weight tile in
registers on the CUDA cores, again for each tile of ``TILE_ROWS`` activation rows: arithmetic added to the
product's, which a memory-bound (decode) product hides and a compute-bound one (prefill) pays.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from autotp.cost_models.topology import Topology, load_topology

# Activation rows one dequantized weight tile serves before the next tile of rows dequantizes it again: the M of
# one output tile (128 in CUTLASS's Hopper GEMMs and DeepSeek's DeepGEMM FP8 kernels).  A stated assumption about
# the fused kernels, not a measurement.
TILE_ROWS = 128


def dequantize_time(ops: float, elements: float, m: float, topology: Topology) -> float:
    """Seconds a fused kernel spends dequantizing ``elements`` weight elements at ``ops`` operations each, once
    per tile of ``TILE_ROWS`` of its ``m`` rows, on the CUDA cores (``vector_flops``; peak where a profile lacks
    it)."""
    rate = topology.vector_flops or topology.peak_flops
    return ops * elements * math.ceil(max(m, 1) / TILE_ROWS) / rate


def memory_time(nbytes: float, topology: Topology) -> float:
    return nbytes / (topology.hbm_bandwidth * topology.memory_efficiency)


def op_time(flops: float, nbytes: float, topology: Topology | str | Path | None) -> float:
    """Seconds of an op that is not a matrix product (one FLOP an element): the slower of its arithmetic at
    peak and its memory traffic.  ``topology``: a profile name, a path or a loaded profile (None: the default)."""
    topology = load_topology(topology)
    return max(flops / topology.peak_flops, memory_time(nbytes, topology))


def product_time(
    m: float,
    n: float,
    k: float,
    topology: Topology | str | Path | None,
    groups: float = 1,
    ragged: bool = False,
    nbytes: float = 0.0,
    dequantized: float = 0.0,
) -> float:
    """Seconds of ``groups`` products [m, k] @ [k, n] in one kernel on one device (``ragged``: a grouped
    product whose groups run like separate products) with ``dequantized`` seconds of dequantizing its weight
    (``dequantize_time``), or of moving their ``nbytes``, whichever is slower."""
    topology = load_topology(topology)
    figures = topology.products
    flops = 2.0 * groups * m * n * k
    if flops <= 0:
        return memory_time(nbytes, topology)
    group = 2.0 * m * n * k / (figures.peak_fraction * topology.peak_flops)
    further = min(figures.group_overhead_s, group) if ragged else 0.0  # a group wastes at most its own time
    arithmetic = groups * group + figures.overhead_s + (max(groups, 1) - 1) * further + dequantized
    return max(arithmetic, memory_time(nbytes, topology))


def product_fraction(
    m: float, n: float, k: float, topology: Topology | str | Path | None, groups: float = 1, ragged: bool = False
) -> float:
    """The fraction of peak FLOP/s a product reaches at this shape (arithmetic only)."""
    topology = load_topology(topology)
    return 2.0 * groups * m * n * k / (topology.peak_flops * product_time(m, n, k, topology, groups, ragged))


def fit_products(points, peak_flops: float, overhead_s: float | None = None) -> dict:
    """(peak_fraction, overhead_s) that price ``points`` [(m, n, k, measured fraction of peak)] best: least
    squares of the relative time error, which is linear in 1/peak_fraction and overhead_s.  With ``overhead_s``
    given (a device with one published point), only the fraction is fitted."""
    rows = [(f, f * peak_flops / (2.0 * m * n * k)) for m, n, k, f in points]  # (fraction, 1 / measured time)
    if not rows:
        raise ValueError("no measured products to fit")
    if overhead_s is None and len(rows) > 1:
        # minimise sum (a f + t0 / t - 1)^2 over a = 1 / peak_fraction and t0 >= 0 (2 x 2 normal equations)
        sff, sfu, suu = (sum(f * f for f, _ in rows), sum(f * u for f, u in rows), sum(u * u for _, u in rows))
        sf, su = sum(f for f, _ in rows), sum(u for _, u in rows)
        det = sff * suu - sfu * sfu
        if det > 0:
            a, t0 = (sf * suu - su * sfu) / det, (sff * su - sfu * sf) / det
            if t0 >= 0:
                return {"peak_fraction": 1 / a, "overhead_s": t0}
        overhead_s = 0.0
    t0 = overhead_s or 0.0
    a = sum(f * (1 - t0 * u) for f, u in rows) / sum(f * f for f, _ in rows)
    return {"peak_fraction": 1 / a, "overhead_s": t0}


def fraction_at(point, fitted: dict, peak_flops: float) -> float:
    """The fraction of peak ``fitted`` figures predict for the shape of ``point`` (m, n, k, ...)."""
    flops = 2.0 * point[0] * point[1] * point[2]
    return flops / peak_flops / (flops / (fitted["peak_fraction"] * peak_flops) + fitted["overhead_s"])


def held_out(points, peak_flops: float, every: int = 4) -> dict:
    """Fit on the points whose index is not a multiple of ``every``, predict the others: the errors a fit makes
    on sizes it never saw (with ``every`` >= the number of points: leave one out, each point in turn)."""
    points = list(points)
    if len(points) < 3:
        raise ValueError("held-out errors need at least 3 measured products")
    if every >= len(points):
        folds = [[i] for i in range(len(points))]
    else:
        folds = [[i for i in range(len(points)) if i % every == 0]]
    rows = []
    for fold in folds:
        fitted = fit_products([p for i, p in enumerate(points) if i not in fold], peak_flops)
        for i in fold:
            predicted = fraction_at(points[i], fitted, peak_flops)
            rows.append((*points[i][:4], predicted, abs(predicted / points[i][3] - 1)))
    errors = [r[-1] for r in rows]
    return {"rows": rows, "median": statistics.median(errors), "max": max(errors)}


def fit_group_overhead(grouped, fitted: dict, peak_flops: float) -> float:
    """Seconds each further group adds to a ragged grouped product (at most that group's own time, as
    ``product_time`` charges it), fitted to ``grouped`` [(m, n, k, groups, measured fraction of peak)] given the
    plain products' figures: the least squares of the relative time error over a fine grid of values."""
    rows = []
    for m, n, k, g, f in grouped:
        group = 2.0 * m * n * k / (fitted["peak_fraction"] * peak_flops)
        rows.append((g * group + fitted["overhead_s"], group, g - 1, 2.0 * g * m * n * k / (f * peak_flops)))
    if not rows:
        return fitted["overhead_s"]

    def error(t: float) -> float:
        return sum(((base + further * min(t, group)) / measured - 1) ** 2 for base, group, further, measured in rows)

    top = 2 * max(measured for *_, measured in rows)
    return min((top * i / 4000 for i in range(4001)), key=error)
