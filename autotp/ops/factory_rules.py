"""Sharding rule of new tensors of a given size (``x.new_zeros(size)``, ``new_full``, ``new_empty``): every element
has the same value (or none yet), so any dim of fixed size may be split, each rank making its own piece; ``x`` is read
for its dtype and device only, in whatever placement it has."""

from __future__ import annotations

from torch.fx import Node

from autotp.ops.strategies import Context, Strategy
from autotp.placement import R


def new_filled(node: Node, ctx: Context) -> list[Strategy]:
    x, sizes = node.args[:2]
    outputs = [R] + [s for d, size in enumerate(sizes) if isinstance(size, int) for s in ctx.shard_options(node, d)]
    return [Strategy(ctx.fill(node, {x: p}), out) for p in ctx.output_options(x) or [R] for out in outputs]
