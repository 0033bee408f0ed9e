"""`autotp calibrate`: measure collectives on the current process group (kept as measured points, read
between sizes, and fitted to latency + bytes/busbw), time matrix products on rank 0's device
(calibrate_products.py), and write a topology profile that prices plans with the measured figures."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from autotp.cost_models import collective_time, load_topology
from autotp.cost_models.communication import ring_steps
from autotp.tools.calibrate_products import measure_products, product_table

OPS = ("all_reduce", "all_gather", "reduce_scatter")
SIZES = tuple(4096 * 4**k for k in range(8))  # 4 KiB .. 64 MiB


def _run_once(op: str, nbytes: int, world: int, device) -> None:
    numel = nbytes // 4
    if op == "all_reduce":
        dist.all_reduce(torch.ones(numel, device=device))
    elif op == "all_gather":
        dist.all_gather_into_tensor(torch.empty(numel, device=device), torch.ones(numel // world, device=device))
    else:
        dist.reduce_scatter_tensor(torch.empty(numel // world, device=device), torch.ones(numel, device=device))


def _samples(nbytes: int) -> int:
    """Many samples for small messages (cheap, and noisy), a few for large ones."""
    return 100 if nbytes <= 256 * 1024 else 30 if nbytes <= 4 * 2**20 else 8


def measure(device=None) -> dict:
    """op -> {bytes: seconds}: the fastest of many single-collective samples, each timed on the
    slowest rank after a barrier.  The minimum, not the median: on a shared or virtual machine the
    scheduler only ever adds time, and the best case is what repeats from run to run."""
    world = dist.get_world_size()
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu")
    results: dict = {}
    for op in OPS:
        results[op] = {}
        for nbytes in SIZES:
            _run_once(op, nbytes, world, device)
            best = float("inf")
            for _ in range(_samples(nbytes)):
                dist.barrier()
                start = time.perf_counter()
                _run_once(op, nbytes, world, device)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                best = min(best, elapsed.item())
            results[op][nbytes] = best
    return results


def fit(op: str, samples: dict, world: int) -> dict:
    """t = latency + factor * bytes / busbw, by least median of relative errors (Rousseeuw's LMedS):
    the line through the pair of measured sizes that leaves the smallest median error over all
    sizes.  Robust against the few sizes where caches or the scheduler bend the curve."""
    factor = ring_steps(op, world)[1]
    points = sorted((factor * b, t) for b, t in samples.items())
    best = None
    for i, (c1, t1) in enumerate(points):
        for c2, t2 in points[i + 1 :]:
            inverse_bw = max((t2 - t1) / (c2 - c1), 1e-15)
            latency = max(t1 - inverse_bw * c1, 0.0)
            errors = sorted(abs(latency + inverse_bw * c - t) / t for c, t in points)
            score = (statistics.median(errors), sum(errors))
            if best is None or score < best[0]:
                best = (score, latency, inverse_bw)
    _, latency, inverse_bw = best
    return {"latency_s": latency, "busbw": 1 / inverse_bw}


def measured_entry(op: str, samples: dict, world: int) -> dict:
    """What the profile keeps of one collective: its fitted line (printed, and the figures of collectives never
    measured) and its measured points in bus bytes, which collective_time reads between the sizes."""
    factor = ring_steps(op, world)[1]
    return {**fit(op, samples, world), "points": sorted([factor * b, t] for b, t in samples.items())}


def _device_figures(device) -> dict:
    """Copy bandwidth of this device, measured, and its memory."""
    big = torch.empty(16 * 2**20, device=device)
    big.clone()
    start = time.perf_counter()
    for _ in range(5):
        big.clone()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    bandwidth = 5 * 2 * big.numel() * 4 / (time.perf_counter() - start)
    if torch.cuda.is_available():
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"hbm_bandwidth": bandwidth, "memory_bytes": float(memory)}


def profile(measured: dict, world: int, device, products: dict) -> dict:
    """The profile: the collectives' fitted lines, and the products' table with peak_flops the fastest of them."""
    host = socket.gethostname()
    source = f"measured by autotp calibrate on {host}, {datetime.date.today()}, {world} ranks"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    fitted = {op: measured_entry(op, samples, world) for op, samples in measured.items()}
    table, peak = product_table(products, f"measured by autotp calibrate on {host}, {datetime.date.today()}")
    figures = {
        **_device_figures(device),
        "peak_flops": peak,
        "nodes": world // local,
        "gpus_per_node": local,
        "memory_efficiency": 1.0,
        "intra_base_latency_s": fitted["all_reduce"]["latency_s"],
        "intra_step_latency_s": 0.0,
        "intra_busbw": fitted["all_reduce"]["busbw"],
    }
    return {
        "name": f"calibrated-{host}-{world}",
        "description": f"{world} ranks of {dist.get_backend()} on {host}",
        "figures": {k: {"value": v, "source": source} for k, v in figures.items()},
        "products": table,
        "measured": fitted,
        "samples": {op: {str(b): t for b, t in s.items()} for op, s in measured.items()},
    }


def comparison(path: Path) -> tuple[list[tuple], float]:
    """(op, bytes, measured s, predicted s, relative error) rows and their median error, each size predicted by the
    profile measured without it (leave one size out): the error a size calibration never saw gets, not a residual."""
    raw = json.loads(Path(path).read_text())
    topo = load_topology(path)
    world = topo.devices
    samples = {op: {int(b): t for b, t in s.items()} for op, s in raw["samples"].items()}
    rows = []
    for size in sorted(samples["all_reduce"]):  # every collective (what collective_time reads) without the size
        lines = {op: measured_entry(op, {b: t for b, t in s.items() if b != size}, world) for op, s in samples.items()}
        held_out = dataclasses.replace(
            topo,
            measured=lines,
            intra_base_latency_s=lines["all_reduce"]["latency_s"],
            intra_busbw=lines["all_reduce"]["busbw"],
        )
        rows += [
            (op, size, s[size], collective_time(op, size, world, held_out)) for op, s in samples.items() if size in s
        ]
    rows = [(op, b, t, p, abs(p - t) / t) for op, b, t, p in rows]
    return rows, statistics.median(r[4] for r in rows)


def calibrate(out: str | Path, device=None) -> Path | None:
    """Collective on the current process group; rank 0 writes the profile."""
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu")
    measured = measure(device=device)
    if dist.get_rank() != 0:
        return None
    path = Path(out)
    products = measure_products(device)
    path.write_text(json.dumps(profile(measured, dist.get_world_size(), device, products), indent=1))
    return path
