"""Sharding rules of ops that act along some dims and map the others through: reductions, picks, repeats and
windows (max, logsumexp, vector norms, gather, scatter, repeat, unfold, im2col), glu, flip, pooling and weight norm.
The other dims stay sharded; the dims they act along are not sums of their parts,
so they are never split, except where each rank's rows pick from a whole input (gather's index)."""

from __future__ import annotations

import torch
from torch.fx import Node

from autotp.ops.layout_rules import positive_dim
from autotp.ops.strategies import Context, Strategy, summable
from autotp.placement import P, R, Shard

aten = torch.ops.aten


# (dims, keepdim) argument positions of reductions that are no sum of parts, and their defaults
_REDUCED_ARGS = {
    aten.max.dim: (1, 2),
    aten.min.dim: (1, 2),
    aten.amax.default: (1, 2),
    aten.amin.default: (1, 2),
    aten.logsumexp.default: (1, 2),
    aten.argmax.default: (1, 2),
    aten.argmin.default: (1, 2),
    aten.linalg_vector_norm.default: (2, 3),
}


def reduced(node: Node, ctx: Context) -> list[Strategy]:
    """max / amax / logsumexp / argmax / a vector norm over some dims (none given: all): any other dim stays
    sharded; a reduced dim is no sum of its parts, so it is never split.  max.dim's values and indices alike."""
    x = node.args[0]
    n = len(ctx.shape(x))
    at, keep_at = _REDUCED_ARGS[node.target]
    dims = node.args[at] if len(node.args) > at else None
    dims = range(n) if dims is None or dims == [] else [dims] if isinstance(dims, int) else dims
    dims = {positive_dim(d, n) for d in dims}
    keep = bool(node.args[keep_at]) if len(node.args) > keep_at else bool(node.kwargs.get("keepdim", False))
    found = []
    for d in set(range(n)) - dims:
        od = d if keep else d - sum(1 for r in dims if r < d)
        for s in ctx.shard_options(x, d) + ctx.token_options(x, d):
            out = s.at(od)
            found.append(Strategy(ctx.fill(node, {x: s}), (out, out) if isinstance(node.meta["val"], tuple) else out))
    return found


def repeat(node: Node, ctx: Context) -> list[Strategy]:
    """x.repeat(sizes): a dim repeated once passes through (the sizes may add leading dims); a dim split evenly and
    repeated m times is m blocks, each split alike (DiffLlama's value heads repeated over both halves of heads); x
    held whole on every rank gives each rank its slice of the copies (KV heads tiled over more ranks than KV
    heads: every rank's query heads read all of them)."""
    x, sizes = node.args[0], node.args[1]
    shape = ctx.shape(x)
    lead = len(sizes) - len(shape)
    found = [
        Strategy(ctx.fill(node, {x: s}), s.at(d + lead))
        for d in range(len(shape))
        if sizes[d + lead] == 1
        for s in ctx.shard_options(x, d) + ctx.token_options(x, d)
    ]
    copied = [d for d in range(len(shape)) if isinstance(sizes[d + lead], int) and sizes[d + lead] > 1]
    found += [
        Strategy(ctx.fill(node, {x: Shard(d)}), Shard(d + lead, (shape[d],) * sizes[d + lead]))
        for d in copied
        if Shard(d) in ctx.shard_options(x, d)
    ]
    if len(copied) == 1 and not lead:  # x held whole: each rank's slice of the copies (tiled KV heads, more ranks)
        whole = [s for d in range(len(shape)) for s in ctx.shard_options(x, d) if s.whole(ctx.world)]
        found += [
            Strategy(ctx.fill(node, {x: src}), out)
            for src in [R, *whole]
            for out in ctx.shard_options(node, copied[0])
            if out.chunks is None and out.units is None
        ]
    return found


def unfold(node: Node, ctx: Context) -> list[Strategy]:
    """x.unfold(dim, size, step): windows along ``dim`` (their elements a new last dim); any other dim stays split."""
    x = node.args[0]
    n = len(ctx.shape(x))
    at = positive_dim(node.args[1], n)
    return [
        Strategy(ctx.fill(node, {x: s}), s)
        for d in range(n)
        if d != at
        for s in ctx.shard_options(x, d) + ctx.token_options(x, d)
    ]


def im2col(node: Node, ctx: Context) -> list[Strategy]:
    """im2col(x [N, C, H, W]): [N, C * kh * kw, windows], channel c's window values rows c*k .. c*k + k - 1, so a
    split of the channels (in whole units or not) is the same split of those rows (ConvBERT's span convolution of
    the heads' values); the batch passes through; partial sums stay partial (a linear op, its padding zeros)."""
    x = node.args[0]
    channels = len(ctx.shape(x)) - 3  # 1 with a batch dim, 0 without
    found = [Strategy(ctx.fill(node, {x: P}), P)] if summable(x) else []
    found += [
        Strategy(ctx.fill(node, {x: s}), s)
        for s in ctx.shard_options(x, channels)
        if s.chunks is None and s.of is None and s.groups is None
    ]
    return found + [Strategy(ctx.fill(node, {x: s}), s) for s in ctx.token_options(x, 0)] if channels else found


def gather(node: Node, ctx: Context) -> list[Strategy]:
    """gather(x, dim, index) / scatter(x, dim, index, value or src): another dim of equal size in x and the index
    (and src) split alike; for gather also ``dim`` itself in the index alone, x read whole (each row of the index
    picks from all of x)."""
    x, at, index = node.args[:3]
    src = node.args[3] if len(node.args) > 3 and isinstance(node.args[3], Node) else None
    shape, n = ctx.shape(x), len(ctx.shape(x))
    at = positive_dim(at, n)
    found = []
    for d in range(n):  # (shard options are of static sizes alone)
        alike = [ctx.shape(t)[d] for t in (index, src) if t is not None]
        if d != at and ctx.static(shape[d]) and all(ctx.static(v) and v == shape[d] for v in alike):
            found += [
                Strategy(ctx.fill(node, {x: s, index: s, **({src: s} if src is not None else {})}), s)
                for s in ctx.shard_options(x, d)
            ]
    if node.target == aten.gather.default:
        found += [Strategy(ctx.fill(node, {index: s}), s) for s in ctx.shard_options(index, at)]
    return found


# ---- ops that compute along some dims and map the others through ----------------------------------


def _through(node: Node, ctx: Context, acted: set) -> list[Strategy]:
    """Any dim of input 0 outside ``acted`` may stay sharded; the output keeps it at the same dim."""
    x = node.args[0]
    n = len(ctx.shape(x))
    return [
        Strategy(ctx.fill(node, {x: s}), s)
        for d in range(n)
        if d not in acted
        for s in ctx.shard_options(x, d) + ctx.token_options(x, d)
    ]


def along_dims(node: Node, ctx: Context) -> list[Strategy]:
    """glu(x, dim) halves ``dim``, flip(x, dims) reverses ``dims``: every other dim passes through.  glu's dim
    split block by block, each half alike (a conformer's pointwise conv before it), gives each rank its slice
    of the gated output."""
    x = node.args[0]
    n = len(ctx.shape(x))
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
    acted = {positive_dim(d, n) for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    found = _through(node, ctx, acted)
    if node.target == aten.glu.default:
        (at,) = acted
        found += [
            Strategy(ctx.fill(node, {x: s}), s.block(0, s.chunks[0], ctx.world))
            for s in ctx.shard_options(x, at)
            if s.chunks is not None and len(s.chunks) == 2 and s.chunks[0] == s.chunks[1] and s.groups is None
        ]
    return found


def last_dims(count: int):
    """Ops over the last ``count`` dims -- pooling and resampling of an image or a signal, tril / triu of a matrix:
    the leading dims (batch, channels, heads) pass through."""

    def rule(node: Node, ctx: Context) -> list[Strategy]:
        n = len(ctx.shape(node.args[0]))
        return _through(node, ctx, set(range(n - count, n)))

    rule.__name__ = f"last_{count}_dims"
    return rule


def weight_norm(node: Node, ctx: Context) -> list[Strategy]:
    """_weight_norm(v, g, dim) = v * g / ||v|| over every dim but ``dim``: ``dim`` split in v and g alike."""
    v, g = node.args[0], node.args[1]
    n = len(ctx.shape(v))
    dim = positive_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), n)
    if len(ctx.shape(g)) != n:
        return []
    return [Strategy(ctx.fill(node, {v: s, g: s}), s) for s in ctx.shard_options(v, dim) if s.chunks is None]
