"""Spawn N gloo ranks on this machine and run a test function on each (failures propagate)."""

from __future__ import annotations

import functools
import re
from collections import Counter

import pytest
import torch
from torch.distributed.tensor.debug._comm_mode import NATIVE_TO_PY_MAPPING, c10d_collective_ops
from torch.utils._python_dispatch import TorchDispatchMode

from autotp.tools.spawn import exit_quietly, free_port, local_context, run_local
from tests.helpers.shared_capture import capture_first

__all__ = [
    "AT_THREE_RANKS",
    "CollectiveCounter",
    "block_of",
    "comm_counts",
    "exit_quietly",
    "plan_ops",
    "run_ranks",
    "run_unsupervised",
    "weight_collectives",
]

# the eager c10d ops (gloo's polled waits) under the names of their functional twins
_FUNCTIONAL = {
    "allreduce_": "all_reduce",
    "_allgather_base_": "all_gather_into_tensor",
    "_reduce_scatter_base_": "reduce_scatter_tensor",
    "alltoall_base_": "all_to_all_single",
}
# the functional ops under the names a plan's collectives use (Plan.collective_counts)
_PLAN = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}


# A check's rank counts: 3 (uneven splits, the most it exercises) in the default tier, 2 and 4 in the slow one
AT_THREE_RANKS = [pytest.param(2, marks=pytest.mark.slow), 3, pytest.param(4, marks=pytest.mark.slow)]


def run_ranks(world: int, fn, *args, captures=None) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; an exception on any rank fails the caller.
    Returns what each rank returned, in rank order.  ``captures()``: (model, args) pairs the ranks will
    parallelize, built as they build them: captured once, before the ranks start (tests/helpers/shared_capture.py)."""
    return run_local(world, fn, *args, setup=functools.partial(capture_first, captures) if captures else None)


def run_unsupervised(world: int, target, reports: int, timeout: float = 240, end: bool = False) -> list:
    """Start ``target(rank, port, queue)`` on ``world`` processes that are not stopped when one of them dies
    (tests that kill a rank on purpose) and return the first ``reports`` items they put on the queue.
    ``end``: then end them all (a stuck rank would never leave)."""
    ctx = local_context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(rank, port, queue)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        found = [queue.get(timeout=timeout) for _ in range(reports)]
    finally:
        for p in procs:
            if end:
                p.kill()
            p.join(timeout=30)
    return found


class CollectiveCounter(TorchDispatchMode):
    """The collectives that run, counted as CommDebugMode counts them (``comm_counts`` reads either), without its
    module tracking, which fails inside FlexAttention's autograd (it traces the backward during the forward)."""

    supports_higher_order_operators = True  # FlexAttention's op passes through (it is no collective)

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def get_comm_counts(self) -> dict:
        return dict(self.counts)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        packet = getattr(func, "_overloadpacket", None)
        if packet in c10d_collective_ops or packet in NATIVE_TO_PY_MAPPING:
            self.counts[NATIVE_TO_PY_MAPPING.get(packet, packet)] += 1
        return func(*args, **(kwargs or {}))


def comm_counts(comm) -> dict:
    """A CommDebugMode's counts by collective: {"all_reduce": n, "all_gather_into_tensor": m, ...}."""
    counts: dict = {}
    for op, n in comm.get_comm_counts().items():
        name = str(op).split(".")[-1]
        name = _FUNCTIONAL.get(name, name)
        counts[name] = counts.get(name, 0) + n
    return counts


def plan_ops(counts: dict) -> dict:
    """``comm_counts`` under the plan's names ({"all_reduce", "all_gather", "reduce_scatter"}), to compare
    with ``Plan.collective_counts``; a collective a plan never names keeps its own name (and fails the comparison)."""
    found: Counter = Counter()
    for name, n in counts.items():
        found[_PLAN.get(name, name)] += n
    return dict(found)


def block_of(module_path: str) -> int | None:
    """The block index in a module path (``model.layers.3.mlp`` -> 3: its first numbered part); None outside blocks."""
    found = re.search(r"\.(\d+)(\.|$)", module_path)
    return int(found.group(1)) if found else None


_GRADIENT_ONLY = {"reduce_grad", "sum_group_grads"}


def weight_collectives(gm) -> list[str]:
    """Collectives in a sharded program whose input is computed from parameters and buffers alone (a weight,
    or a view, transpose, slice or cast of one): a weight travelling at run time, which plans must never do.
    ``reduce_grad`` and ``sum_group_grads`` are not: their forward is the identity, their backward sums the
    weight's gradient (a replicated norm weight read by sharded ops; a unit shared by several ranks)."""
    from_weights: set = set()
    found = []
    for node in gm.graph.nodes:
        inputs = node.all_input_nodes
        if node.op == "get_attr" or (node.op == "call_function" and inputs and all(a in from_weights for a in inputs)):
            from_weights.add(node)
        fn = node.target
        if (
            getattr(fn, "__module__", "") == "autotp.runtime.collectives"
            and fn.__name__ not in _GRADIENT_ONLY
            and node.args[0] in from_weights
        ):
            found.append(f"{fn.__name__}({node.args[0].name})")
    return found
