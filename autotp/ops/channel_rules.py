"""Sharding rules of ops over channels (dim 1): convolutions, split by output channels, input channels (partial
sums) or per channel when depthwise, and batch norm in eval mode, a per-channel affine map."""

from __future__ import annotations

from torch.fx import Node

from autotp.ops.strategies import Context, Strategy, contractible
from autotp.placement import P


def conv_groups(node: Node):
    """conv1d / conv2d(x, w, bias, stride, padding, dilation, groups)'s groups."""
    return node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)


def convolution(node: Node, ctx: Context) -> list[Strategy]:
    """conv1d / conv2d (channels at dim 1, weight [out, in / groups, ...]): output channels split (weight rows,
    bias alike), input channels split into partial sums (no bias), the batch split; a depthwise conv (one group
    per channel) splits its channels in input, weight and output alike, in any layout no two ranks share (q, k
    and v concatenated before a short conv: each block by heads)."""
    x, w = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    groups = conv_groups(node)
    sx, sw = ctx.shape(x), ctx.shape(w)
    if not isinstance(groups, int) or not all(ctx.static(v) for v in (sx[1], sw[0], sw[1])):
        return []
    with_bias = isinstance(bias, Node)
    found = [Strategy(ctx.fill(node, {x: s}), s) for s in ctx.shard_options(node, 0) if s.chunks is None]
    if groups == 1:  # output channels, block by block too (a gate's halves: glu after it)
        found += [
            Strategy(ctx.fill(node, {w: s.at(0), **({bias: s.at(0)} if with_bias else {})}), s)
            for s in ctx.shard_options(node, 1)
            if s.chunks is None or s.groups is None
        ]
        if not with_bias:
            found += [
                Strategy(ctx.fill(node, {x: s, w: s.at(1)}), P)
                for s in contractible(ctx.shard_options(x, 1), 1, ctx.world, blocks=True)
            ]
            found.append(Strategy(ctx.fill(node, {x: P}), P))
    elif groups == sx[1] == sw[0] and sw[1] == 1:
        found += [
            Strategy(ctx.fill(node, {x: s, w: s.at(0), **({bias: s.at(0)} if with_bias else {})}), s)
            for s in ctx.shard_options(node, 1)
            if not s.grouped(ctx.world)
        ]  # fused blocks too: per channel
    return found


def batch_norm(node: Node, ctx: Context) -> list[Strategy]:
    """batch_norm in eval mode, a per-channel affine map of fixed statistics: channels (dim 1) split with the
    weight, bias and running statistics alike, or another dim split with them whole.  In training mode it takes
    statistics over the batch and writes the running ones in place: no rule, so it runs replicated."""
    x, *per_channel = node.args[:5]
    training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training", True)
    if training is not False:
        return []
    per_channel = [a for a in per_channel if isinstance(a, Node)]
    found = [
        Strategy(ctx.fill(node, {x: s, **{a: s.at(0) for a in per_channel}}), s)
        for s in ctx.shard_options(x, 1)
        if s.chunks is None
    ]
    for d in range(len(ctx.shape(x))):
        if d != 1:
            found += [Strategy(ctx.fill(node, {x: s}), s) for s in ctx.shard_options(x, d) + ctx.token_options(x, d)]
    return found
