"""The local launcher (autotp.tools.spawn) that the demo, the examples and these tests start ranks with."""
from __future__ import annotations

import sys

from autotp.tools.spawn import run_local


def _large(rank: int, world: int) -> str:
    return str(rank) * 100_000


def _warm(rank: int, world: int) -> bool:
    return "autotp.tools.warmup" in sys.modules and "torch.export._trace" in sys.modules


def test_large_results_come_back():
    """Results bigger than a pipe's buffer together: the ranks' puts block until the caller reads them (it
    once read only after joining, and both waited for ever)."""
    assert run_local(4, _large) == [str(rank) * 100_000 for rank in range(4)]


def test_ranks_start_from_the_warmed_fork_server():
    assert run_local(2, _warm) == [True, True]
