"""Pipeline and data-parallel pricing on top of a tensor-parallel plan: pure functions.

A schedule over ``p`` stages with ``m`` micro-batches runs ``m + (p - 1) / v`` stage-times, ``v``
the virtual stages per device (1 for GPipe and 1F1B, more for interleaved 1F1B; Narayanan et al.
2021 section 2.2).  Activations a stage holds in flight: GPipe all ``m`` micro-batches, 1F1B
``min(p - i, m)`` on stage ``i`` (the first holds up to ``p``), interleaved 1F1B that times
``1 + (p - 1) / (p v)`` (Korthikanti et al. 2022 section 4.2.3).
"""
from __future__ import annotations

import dataclasses
import itertools
import math

from .communication import collective_time
from .topology import Topology

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def balance_stages(costs: list[float], parts: int, fits=None) -> list[tuple[int, int]] | None:
    """Contiguous ``[start, end)`` ranges of ``costs`` (one per block, the embedding's cost added to
    the first block and the head's to the last) into ``parts`` non-empty parts whose largest sum is
    as small as possible: the stage boundaries that balance stage time.

    ``fits(stage, start, end)``: whether stage ``stage`` holding blocks ``[start, end)`` fits in memory; it must
    hold for every range inside one that fits (memory grows with blocks) and for a later stage wherever it holds
    for an earlier one (GPipe and 1F1B: no more micro-batches in flight).  Then the slowest stage is as fast as
    the memory allows, and None means no split fits."""
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} blocks into {parts} pipeline stages: use at most {n} stages")
    balanced = _time_balanced(costs, parts)
    if fits is None or all(fits(k, a, b) for k, (a, b) in enumerate(balanced)):
        return balanced
    if _cut(costs, parts, fits, math.inf) is None:
        return None
    prefix = list(itertools.accumulate(costs, initial=0.0))
    fastest = max(prefix[b] - prefix[a] for a, b in balanced)  # no split is faster than the time-balanced one
    bounds = sorted({prefix[b] - prefix[a] for a in range(n) for b in range(a + 1, n + 1)
                     if prefix[b] - prefix[a] >= fastest})  # the slowest stage's time is one of these
    lo, hi = 0, len(bounds)  # _cut(bounds[hi]) succeeds (math.inf when hi == len(bounds))
    while lo < hi:
        mid = (lo + hi) // 2
        if _cut(costs, parts, fits, bounds[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    return _cut(costs, parts, fits, bounds[hi] if hi < len(bounds) else math.inf)


def _time_balanced(costs: list[float], parts: int) -> list[tuple[int, int]]:
    n = len(costs)
    lo, hi = max(costs), sum(costs)
    for _ in range(60):  # the smallest largest-part sum a greedy cut achieves with at most `parts` parts
        mid = (lo + hi) / 2
        if _greedy_parts(costs, mid) <= parts:
            hi = mid
        else:
            lo = mid
    ranges, start, total = [], 0, 0.0
    for i, cost in enumerate(costs):
        left = parts - len(ranges) - 1  # parts still to open after the current one
        if i > start and (total + cost > hi or n - i == left):
            ranges.append((start, i))
            start, total = i, 0.0
        total += cost
    ranges.append((start, n))
    return ranges


def _greedy_parts(costs: list[float], limit: float) -> int:
    parts, total = 1, 0.0
    for cost in costs:
        if total and total + cost > limit:
            parts, total = parts + 1, 0.0
        total += cost
    return parts


def _cut(costs: list[float], parts: int, fits, limit: float) -> list[tuple[int, int]] | None:
    """A split whose stages each take at most ``limit`` seconds and fit in memory, or None.

    From the last stage back, each takes as many blocks as fit.  That is never worse than any other split: a
    later stage holds no more micro-batches in flight than an earlier one, so what an earlier stage could hold
    of the blocks left, the later one could too (``fits`` is monotone in the stage and in the range)."""
    prefix = list(itertools.accumulate(costs, initial=0.0))
    ranges, end = [], len(costs)
    for stage in range(parts - 1, 0, -1):
        start = end
        while start > stage and prefix[end] - prefix[start - 1] <= limit and fits(stage, start - 1, end):
            start -= 1  # leaving a block for every earlier stage
        if start == end:
            return None
        ranges.append((start, end))
        end = start
    if prefix[end] > limit or not fits(0, 0, end):
        return None
    return [(0, end), *ranges[::-1]]


def step_units(schedule: str | None, pp: int, microbatches: int, virtual: int) -> float:
    """Stage-times one step lasts: the micro-batches plus the schedule's bubble."""
    if pp == 1 or schedule is None:
        return float(microbatches)
    return microbatches + (pp - 1) / virtual


def in_flight(schedule: str | None, pp: int, microbatches: int, stage: int, virtual: int) -> float:
    """How many micro-batches' activations stage ``stage`` holds at its peak."""
    if pp == 1 or schedule is None:
        return 1.0
    if schedule == "gpipe":
        return float(microbatches)
    held = float(min(pp - stage, microbatches))
    return held * (1 + (pp - 1) / (pp * virtual)) if schedule == "interleaved-1f1b" else held


def p2p_time(nbytes: float, tp: int, crosses_nodes: bool, topology: Topology) -> float:
    """One activation (or its gradient) sent to the next stage.  Across nodes each of the ``tp``
    ranks sends 1/tp of it over its own NIC and the receivers all-gather it inside the node
    (Megatron's scatter/gather, Narayanan et al. 2021 section 4.1); inside a node over NVLink."""
    if not crosses_nodes:
        return topology.intra_base_latency_s + nbytes / topology.intra_busbw
    if not topology.nics_per_node:
        raise ValueError(f"topology {topology.name} has no NICs (nics_per_node) to send between nodes")
    per_gpu = topology.nic_bandwidth * topology.nics_per_node / topology.gpus_per_node
    return (topology.inter_base_latency_s + nbytes / tp / per_gpu
            + collective_time("all_gather", nbytes, tp, topology))


def dp_topology(topo: Topology, tp: int) -> Topology:
    """The fabric a data-parallel group sees: its members sit ``tp`` ranks apart."""
    per_node = max(1, topo.gpus_per_node // tp)
    nics = max(1, topo.nics_per_node * per_node // topo.gpus_per_node) if topo.nics_per_node else 0
    return dataclasses.replace(topo, gpus_per_node=per_node, nodes=max(1, topo.devices // tp // per_node),
                               nics_per_node=nics)


def dp_sync_time(params: float, grads: float, dp: int, tp: int, data_parallel: str, gathers: int,
                 topology: Topology) -> tuple[float, float]:
    """(gradient reduction, parameter all-gathers) seconds per step for one device's stage.

    DDP all-reduces the gradients; FSDP reduce-scatters them and all-gathers the parameters
    ``gathers`` times (twice per micro-batch when they are freed after use, once when kept)."""
    if dp == 1:
        return 0.0, 0.0
    fabric = dp_topology(topology, tp)
    if data_parallel == "ddp":
        return collective_time("all_reduce", grads, dp, fabric), 0.0
    return (collective_time("reduce_scatter", grads, dp, fabric),
            gathers * collective_time("all_gather", params, dp, fabric))


def exposed_dp_time(reduce: float, gather: float, last_backward: float, compute: float) -> float:
    """What data-parallel traffic adds to the step: gradients are reduced while the last micro-batch
    runs backward (bucketed, as DDP and FSDP do), parameter all-gathers are prefetched during compute."""
    return max(0.0, reduce - last_backward) + max(0.0, gather - compute)


def crosses_nodes(tp: int, dp: int, topology: Topology) -> bool:
    """Neighbouring stages sit tp * dp ranks apart (mesh dims pp, dp, tp outer to inner)."""
    return tp * dp >= topology.gpus_per_node and topology.nodes > 1


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def powers_of_two_dividing(n: int, at_most: int) -> list[int]:
    return [1 << k for k in range(int(math.log2(max(1, at_most))) + 1) if n % (1 << k) == 0]
