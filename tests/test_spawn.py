"""The local launcher (autotp.tools.spawn) that the demo, the examples and these tests start ranks with."""

from __future__ import annotations

import os
import sys

import pytest
from torch.multiprocessing import ProcessRaisedException

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


def _inherited(rank: int, world: int) -> list:
    return sorted(_SET_UP)


_SET_UP: set = set()


def _set_up() -> None:
    _SET_UP.add(os.getpid())


def test_ranks_fork_from_a_process_that_ran_setup():
    """What ``setup`` leaves in memory every rank has (tests share one capture so), and a rank's error still
    reaches the caller."""
    found = run_local(3, _inherited, setup=_set_up)
    assert len(found[0]) == 1 and found[0][0] != os.getpid() and found == [found[0]] * 3
    failed = r"(?s)-- Process 1 terminated with the following error:.*ValueError: rank 1 fails"  # the rank, its error
    with pytest.raises(ProcessRaisedException, match=failed):
        run_local(2, _fails, setup=_set_up)
    with pytest.raises(ProcessRaisedException, match=failed):  # and without setup: started by the fork server
        run_local(2, _fails)


def _fails(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 fails")
