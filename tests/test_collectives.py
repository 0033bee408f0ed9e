"""Each placement conversion and its gradient, against the full tensors, on real gloo ranks."""
from __future__ import annotations

import pytest
import torch

from autotp import collectives
from autotp.placement import P, R, Shard, assemble, take_local
from distributed import run_ranks

SHARDS = [Shard(1), Shard(1, (4, 8, 12)), Shard(0)]


def _conversions(rank: int, world: int) -> None:
    import torch.distributed as dist
    group = dist.group.WORLD.group_name
    torch.manual_seed(0)
    summands = [torch.randn(8, 24, dtype=torch.float64) for _ in range(world)]  # same on every rank
    full = sum(summands)
    upstream = torch.randn(8, 24, dtype=torch.float64)  # d(loss)/d(full), same on every rank
    have = {R: full, P: summands[rank], **{s: take_local(full, s, rank, world) for s in SHARDS}}
    for src in [P, R, *SHARDS]:
        for dst in [R, *SHARDS]:
            x = have[src].clone().requires_grad_()
            y = x
            for fn, extra in collectives.conversion_steps(src, dst, rank, world, group):
                y = fn(y, *extra)
            torch.testing.assert_close(y, have[dst], msg=lambda m, s=src, d=dst: f"{s}->{d}: {m}")
            want_grad = upstream if isinstance(dst, type(R)) else take_local(upstream, dst, rank, world)
            (y * want_grad).sum().backward()
            # the gradient of the source value, in the source's own layout
            expected = take_local(upstream, src, rank, world) if isinstance(src, Shard) else upstream
            torch.testing.assert_close(x.grad, expected, msg=lambda m, s=src, d=dst: f"grad {s}->{d}: {m}")


@pytest.mark.parametrize("world", [2, 4])
def test_conversions_and_their_gradients(world):
    run_ranks(world, _conversions)


def test_take_local_and_assemble_invert_each_other():
    full = torch.arange(2 * 24).view(2, 24)
    for shard in SHARDS[:2]:
        for world in (1, 2, 4):
            parts = [take_local(full, shard, r, world) for r in range(world)]
            assert torch.equal(assemble(parts, shard), full)
