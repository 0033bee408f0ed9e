"""Placement changes at run time, as autograd functions (Megatron's conjugate pairs).

  P -> R   all-reduce forward,  identity backward     (Megatron's g)
  P -> S   reduce-scatter forward, all-gather backward
  R -> R*  identity forward,    all-reduce backward   (f: a replicated input of a sharded op)
  S -> R   all-gather forward,  local slice backward
  R -> S   local slice forward, all-gather backward
Collectives are the functional c10d ops, so CommDebugMode sees them and torch.compile can trace them.
"""
from __future__ import annotations

import torch

from .placement import Partial, Replicate, Shard, assemble, take_local

_c10d = torch.ops._c10d_functional


def _all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    return _c10d.wait_tensor(_c10d.all_reduce(x.contiguous(), "sum", group))


def _all_gather(x: torch.Tensor, shard: Shard, world: int, group: str) -> torch.Tensor:
    moved = x.movedim(shard.dim, 0).contiguous()
    gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(moved, world, group))
    full = assemble(list(gathered.chunk(world, 0)), Shard(0, shard.chunks))
    return full.movedim(0, shard.dim)


def _reduce_scatter(x: torch.Tensor, shard: Shard, world: int, group: str) -> torch.Tensor:
    moved = x.movedim(shard.dim, 0)
    if shard.chunks is not None:  # make each rank's blocks contiguous, in rank order
        moved = torch.cat([take_local(moved, Shard(0, shard.chunks), r, world) for r in range(world)], 0)
    out = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(moved.contiguous(), "sum", world, group))
    return out.movedim(0, shard.dim)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard, world, group):
        ctx.args = (shard, world, group)
        return _reduce_scatter(x, shard, world, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, *ctx.args), None, None, None


class _ReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard, rank, world, group):
        ctx.args = (shard, rank, world)
        return _all_gather(x, shard, world, group)

    @staticmethod
    def backward(ctx, grad):
        return take_local(grad, *ctx.args).contiguous(), None, None, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard, rank, world, group):
        ctx.args = (shard, world, group)
        return take_local(x, shard, rank, world).contiguous()

    @staticmethod
    def backward(ctx, grad):
        shard, world, group = ctx.args
        return _all_gather(grad, shard, world, group), None, None, None, None


def all_reduce(x, group):
    return _ReduceForward.apply(x, group)


def reduce_scatter(x, dim, chunks, world, group):
    return _ReduceScatter.apply(x, Shard(dim, chunks), world, group)


def reduce_grad(x, group):
    return _ReduceBackward.apply(x, group)


def gather(x, dim, chunks, rank, world, group):
    return _Gather.apply(x, Shard(dim, chunks), rank, world, group)


def scatter(x, dim, chunks, rank, world, group):
    return _Scatter.apply(x, Shard(dim, chunks), rank, world, group)


def conversion_steps(src, dst, rank: int, world: int, group: str) -> list[tuple]:
    """The runtime calls (function, arguments after the tensor) that turn ``src`` into ``dst``."""
    steps: list[tuple] = []
    if src == dst:
        return steps
    if isinstance(src, Partial) and isinstance(dst, Shard):
        return [(reduce_scatter, (dst.dim, dst.chunks, world, group))]
    if isinstance(src, Partial):
        steps.append((all_reduce, (group,)))
    elif isinstance(src, Shard):
        steps.append((gather, (src.dim, src.chunks, rank, world, group)))
    if isinstance(dst, Shard):
        steps.append((scatter, (dst.dim, dst.chunks, rank, world, group)))
    elif not isinstance(dst, Replicate):
        raise ValueError(f"cannot convert {src} to {dst}")
    return steps


def gather_full(x: torch.Tensor, placement, group) -> torch.Tensor:
    """The full tensor from this rank's piece (no autograd), for checkpoints and tests."""
    if isinstance(placement, Shard):
        return _all_gather(x.detach(), placement, torch.distributed.get_world_size(group), group.group_name)
    return x.detach().clone()
