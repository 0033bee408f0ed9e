"""Alpha-beta (latency + bytes/bandwidth) times for ring collectives and resharding."""
from __future__ import annotations

from autotp.placement import Partial, Replicate, Shard

from .topology import Topology

# (number of latency steps, fraction of the bytes each rank sends) for a ring over n ranks
_RING = {
    "all_reduce": lambda n: (2 * (n - 1), 2 * (n - 1) / n),
    "all_gather": lambda n: (n - 1, (n - 1) / n),
    "reduce_scatter": lambda n: (n - 1, (n - 1) / n),
    "all_to_all": lambda n: (n - 1, (n - 1) / n),
    "broadcast": lambda n: (n - 1, 1.0),
}


def collective_time(op: str, nbytes: float, group_size: int, topology: Topology) -> float:
    """Seconds for one collective on ``nbytes`` (the full tensor) over ``group_size`` ranks."""
    if op not in _RING:
        raise ValueError(f"unknown collective {op!r}; one of {sorted(_RING)}")
    if group_size <= 1:
        return 0.0
    steps, share = _RING[op](group_size)
    return topology.base_latency_s + steps * topology.link_latency_s + share * nbytes / topology.link_bandwidth


def reshard_collective(src, dst) -> str | None:
    """The collective that turns placement ``src`` into ``dst`` ('' if local, None if impossible)."""
    if src == dst:
        return ""
    if isinstance(src, Partial):
        return {Replicate: "all_reduce", Shard: "reduce_scatter"}.get(type(dst))
    if isinstance(src, Replicate):
        return "" if isinstance(dst, Shard) else None
    if isinstance(src, Shard) and isinstance(dst, (Replicate, Shard)):
        return "all_gather"
    return None


def backward_collective(src, dst) -> str:
    """The collective the gradient needs on the way back ('' if none): slicing to a shard gathers."""
    return "all_gather" if src != dst and isinstance(dst, Shard) else ""


def reshard_time(src, dst, nbytes: float, group_size: int, topology: Topology, backward: bool = False) -> float | None:
    """Seconds to convert a tensor of ``nbytes`` (full size) from ``src`` to ``dst`` (and its gradient
    back, with ``backward``); None if impossible."""
    op = reshard_collective(src, dst)
    if op is None:
        return None
    seconds = collective_time(op, nbytes, group_size, topology) if op else 0.0
    if op == "" and src != dst:
        seconds = nbytes / group_size / topology.hbm_bandwidth  # a local slice
    back = backward_collective(src, dst) if backward else ""
    return seconds + (collective_time(back, nbytes, group_size, topology) if back else 0.0)
