"""Spawn N gloo ranks on this machine and run a test function on each (failures propagate)."""
from __future__ import annotations

from autotp.tools.spawn import exit_quietly, run_local

__all__ = ["comm_counts", "exit_quietly", "run_ranks"]

# the eager c10d ops (gloo's polled waits) under the names of their functional twins
_FUNCTIONAL = {"allreduce_": "all_reduce", "_allgather_base_": "all_gather_into_tensor"}


def run_ranks(world: int, fn, *args) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; an exception on any rank fails the caller."""
    run_local(world, fn, *args)


def comm_counts(comm) -> dict:
    """A CommDebugMode's counts by collective: {"all_reduce": n, "all_gather_into_tensor": m, ...}."""
    counts: dict = {}
    for op, n in comm.get_comm_counts().items():
        name = str(op).split(".")[-1]
        name = _FUNCTIONAL.get(name, name)
        counts[name] = counts.get(name, 0) + n
    return counts
