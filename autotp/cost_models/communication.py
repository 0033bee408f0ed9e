"""Collective and resharding times: latency + bytes / bandwidth, the best of the algorithms the
hardware offers (ring; tree across nodes; in-switch reduction inside a node), hierarchical
(inside the nodes, then across them) when a group spans nodes.

``nbytes`` is the full logical tensor: the reduced tensor for all-reduce, the gathered output for
all-gather, the input for reduce-scatter, the broadcast tensor; for all-to-all, each rank's buffer (what it
sends, its own share included: nccl-tests' size: nbytes / n to each rank), since every rank's differs.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

from autotp.cost_models.topology import Topology, load_topology
from autotp.placement import Partial, Replicate, Shard

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def ring_steps(op: str, n: int) -> tuple[int, float]:
    """(latency steps, bus-bandwidth factor) of a ring over n ranks (nccl-tests PERFORMANCE.md)."""
    if op == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if op == "broadcast":
        return n - 1, 1.0
    return n - 1, (n - 1) / n


def _intra(op: str, nbytes: float, n: int, topo: Topology) -> float:
    if n <= 1:
        return 0.0
    steps, factor = ring_steps(op, n)
    ring = topo.intra_base_latency_s + steps * topo.intra_step_latency_s + factor * nbytes / topo.intra_busbw
    if op == "all_reduce" and topo.intra_busbw_nvls:
        nvls = topo.intra_base_latency_s + 2 * topo.intra_step_latency_s + factor * nbytes / topo.intra_busbw_nvls
        return min(ring, nvls)
    return ring


def _inter(op: str, nbytes: float, m: int, topo: Topology) -> float:
    """The across-node phase among m nodes; each node's NICs carry its share of nbytes."""
    if m <= 1:
        return 0.0
    bandwidth = _nics(topo)
    steps, factor = ring_steps(op, m)
    ring = topo.inter_base_latency_s + steps * topo.inter_step_latency_s
    tree = topo.inter_base_latency_s + 2 * math.ceil(math.log2(m)) * topo.inter_step_latency_s
    latency = min(ring, tree) if op in ("all_reduce", "broadcast") else ring
    return latency + factor * nbytes / bandwidth


def _nics(topo: Topology) -> float:
    """A node's network bandwidth, bytes/s (all its NICs)."""
    if not topo.nics_per_node:
        raise ValueError(f"topology {topo.name} has {topo.nodes} nodes but no NICs (nics_per_node)")
    return topo.nic_bandwidth * topo.nics_per_node


def collective_time(op: str, nbytes: float, group_size: int, topology: Topology | str | Path | None) -> float:
    """Seconds for one collective over ``group_size`` consecutive ranks (filling nodes in order);
    ``topology`` as ``parallelize`` takes it: a profile name, a path, a loaded profile (None: the default)."""
    topology = load_topology(topology)
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; one of {', '.join(OPS)}")
    if group_size <= 1:
        return 0.0
    measured = topology.measured.get(op)
    if measured:  # a calibrated profile: this collective as measured on the calibrated group
        return measured_time(measured, ring_steps(op, group_size)[1] * nbytes)
    per_node = min(group_size, topology.gpus_per_node)
    nodes = math.ceil(group_size / per_node)
    if nodes > topology.nodes:
        raise ValueError(
            f"a group of {group_size} ranks does not fit topology {topology.name} "
            f"({topology.nodes} x {topology.gpus_per_node} devices)"
        )
    if op == "all_to_all":
        return _all_to_all(nbytes, group_size, per_node, nodes, topology)
    if nodes == 1:
        return _intra(op, nbytes, group_size, topology)
    if op == "all_reduce":  # reduce-scatter inside, all-reduce of 1/g across, all-gather inside
        return (
            _intra("reduce_scatter", nbytes, per_node, topology)
            + _inter("all_reduce", nbytes, nodes, topology)
            + _intra("all_gather", nbytes, per_node, topology)
        )
    return _intra(op, nbytes, per_node, topology) + _inter(op, nbytes, nodes, topology)


def fused_time(collective_s: float, product_s: float, group_size: int, topology: Topology | str | Path | None) -> float:
    """Seconds of an all-gather fused with the product that reads it, or of a product fused with the
    reduce-scatter of its output (asynchronous TP: inductor's micro-pipeline TP pass, the decomposition in
    ``torch.distributed._symmetric_memory``): the product is cut into one chunk per rank and each chunk's transfer
    overlaps another chunk's product, so the longer of the two runs whole, the shorter's first (all-gather) or
    last (reduce-scatter) chunk does not overlap, and each of the n - 1 chunks handed over pays one NVLink step
    latency (the profile's ``intra_step_latency_s``, NCCL's figure).  Only even pieces in rank order fuse
    (runtime/collectives.py ``in_rank_order``): a padded collective costs ``collective_s + product_s``."""
    topology = load_topology(topology)
    if group_size <= 1:
        return collective_s + product_s
    tail = min(collective_s, product_s) / group_size + (group_size - 1) * topology.intra_step_latency_s
    return max(collective_s, product_s) + tail


def fused_saving(
    collective_s: float, product_s: float, group_size: int, topology: Topology | str | Path | None
) -> float:
    """Seconds fusing saves against running the collective and then the product (negative where the chunks' step
    latencies cost more than the overlap buys): what the sharding ILP credits a fused pair (planning/overlap.py)."""
    return collective_s + product_s - fused_time(collective_s, product_s, group_size, topology)


def measured_time(measured: dict, bus_bytes: float) -> float:
    """Seconds for ``bus_bytes`` (bytes x the ring's bandwidth factor) from a calibrated collective: read
    log-log between its measured sizes ("points"), the largest size's bandwidth above them and the smallest
    size's time below them (latency-bound); its fitted line where the profile has no points.  Gloo and NCCL
    curves bend where messages change protocol or leave the caches, which one line over 4 KiB .. 64 MiB
    cannot follow (held-out errors of both readings: docs/cost-model.md#calibration)."""
    points = measured.get("points")
    if not points:
        return measured["latency_s"] + bus_bytes / measured["busbw"]
    if bus_bytes <= points[0][0]:
        return points[0][1]
    for (b1, t1), (b2, t2) in itertools.pairwise(points):
        if bus_bytes <= b2:
            return t1 * (t2 / t1) ** (math.log(bus_bytes / b1) / math.log(b2 / b1))
    last_bytes, last_time = points[-1]
    return last_time * bus_bytes / last_bytes


def _all_to_all(nbytes: float, group: int, per_node: int, nodes: int, topo: Topology) -> float:
    """Every rank sends nbytes / group to each rank: its own node's share over NVLink and the rest over its
    share of the node's NICs, both at once (the slower decides)."""
    inside = _intra("all_to_all", nbytes * per_node / group, per_node, topo)
    if nodes == 1:
        return inside
    nic = _nics(topo) / topo.gpus_per_node  # this rank's share of its node's NICs
    across = (
        topo.inter_base_latency_s + (nodes - 1) * topo.inter_step_latency_s + nbytes * (group - per_node) / group / nic
    )
    return max(inside, across)


def reshard_collective(src, dst) -> str | None:
    """The collective that turns placement ``src`` into ``dst`` ('' if local, None if impossible)."""
    if src == dst:
        return ""
    if isinstance(src, Partial):  # a disjoint partial (expert parallelism) is a partial sum as it stands
        return {Replicate: "all_reduce", Shard: "reduce_scatter", Partial: ""}.get(type(dst))
    if isinstance(src, Replicate):
        return "" if isinstance(dst, Shard) else None
    if isinstance(src, Shard) and isinstance(dst, (Replicate, Shard)):
        return "all_gather"
    return None


def backward_collective(src, dst) -> str:
    """The collective the gradient needs on the way back ('' if none): slicing to a shard gathers."""
    return "all_gather" if src != dst and isinstance(dst, Shard) else ""


def reshard_time(
    src, dst, nbytes: float, group_size: int, topology: Topology | str | Path | None, backward: bool = False
) -> float | None:
    """Seconds to convert a tensor of ``nbytes`` (full size) from ``src`` to ``dst`` (and its gradient
    back, with ``backward``); None if impossible.  ``topology``: a name, a path or a loaded profile."""
    topology = load_topology(topology)
    op = reshard_collective(src, dst)
    if op is None:
        return None
    seconds = collective_time(op, nbytes, group_size, topology) if op else 0.0
    if op == "" and isinstance(dst, Shard) and src != dst:
        seconds = nbytes / group_size / (topology.hbm_bandwidth * topology.memory_efficiency)  # a local slice
    back = backward_collective(src, dst) if backward else ""
    return seconds + (collective_time(back, nbytes, group_size, topology) if back else 0.0)
