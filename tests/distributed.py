"""Spawn N gloo ranks on this machine and run a test function on each (failures propagate)."""
from __future__ import annotations

from autotp.spawn import exit_quietly, run_local

__all__ = ["exit_quietly", "run_ranks"]


def run_ranks(world: int, fn, *args) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; an exception on any rank fails the caller."""
    run_local(world, fn, *args)
