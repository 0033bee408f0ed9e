"""Overlap in the eager program: a collective is issued ahead of the compute that does not need it and waited for
at its first use.  A dispatch mode records the order of collective issues, waits and compute of a training step of
a sequence-parallel LLaMA (planned under a memory limit that keeps gathered tokens as this rank's piece: the
backward's gathers of them again are issued one ahead, FSDP's backward prefetch) and finds compute between an issue
and its wait that does not read the collective's result."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autotp
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL, logits
from tests.helpers.models import build
from tests.helpers.sequence_parallel import EXAMPLE, regather_limits

_c10d = torch.ops._c10d_functional
ISSUES = (_c10d.all_gather_into_tensor.default, _c10d.reduce_scatter_tensor.default, _c10d.all_reduce.default)
PRODUCTS = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default)


class Order(TorchDispatchMode):
    """Every op in dispatch order: (kind, op, storages read, storages written), kind "issue", "wait" or "compute"."""

    def __init__(self):
        super().__init__()
        self.events: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        reads = {t.untyped_storage()._cdata for t in _tensors((args, kwargs))}
        writes = {t.untyped_storage()._cdata for t in _tensors(out)}
        kind = "issue" if func in ISSUES else "wait" if func is _c10d.wait_tensor.default else "compute"
        self.events.append((kind, func, reads, writes))
        return out


def _tensors(tree) -> list:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def overlapped(events: list) -> list:
    """(collective, product) pairs: a product that ran between the collective's issue and its wait, reading
    nothing the collective wrote."""
    found = []
    for i, (kind, func, _, written) in enumerate(events):
        if kind != "issue":
            continue
        for later, other, reads, _ in events[i + 1 :]:
            if later == "wait" and reads & written:
                break
            if later == "compute" and other in PRODUCTS and not reads & written:
                found.append((func, other))
    return found


def _step(rank: int, world: int, limit: float) -> int:
    model, _, _ = build("llama")
    example = (torch.randint(0, 96, EXAMPLE),)
    sharded = autotp.parallelize(model, example, sequence_parallel=True, memory_limit=limit, recompute=False)
    assert sharded.autotp_plan.cost["regathers"]
    autotp.runtime.transport.register(sharded.autotp_group, shortcuts=False)  # the functional ops, as on NCCL
    x = torch.randint(0, 96, (2, 8))
    with Order() as order:
        out = logits(sharded(x))
        out.square().mean().backward()
    torch.testing.assert_close(out, logits(model(x)), **TOL)
    pairs = overlapped(order.events)
    assert any(c is _c10d.all_gather_into_tensor.default for c, _ in pairs), pairs
    return len(pairs)


def test_a_collective_is_issued_ahead_of_independent_compute_and_waited_at_its_first_use():
    model, _, _ = build("llama")
    _, pieces = regather_limits(model, (torch.randint(0, 96, EXAMPLE),))
    assert all(run_ranks(2, _step, pieces))
