"""The sharding rule of view and reshape: a shard of the input maps to the output dim that carries its data, whole
dims or runs of dims merged and split (ops/views.py does the dim arithmetic),
block-sharded dims by rows or per block."""

from __future__ import annotations

from dataclasses import replace

from torch.fx import Node

from autotp.ops.strategies import Context, Strategy, summable
from autotp.ops.views import map_view_dim, merged_runs, split_runs
from autotp.placement import P, Shard


def view(node: Node, ctx: Context) -> list[Strategy]:
    x = node.args[0]
    src = [ctx.probe(s) for s in ctx.shape(x)]
    dst = [ctx.probe(s) for s in ctx.shape(node)]
    found = [Strategy(ctx.fill(node, {x: P}), P)] if summable(x) else []
    static = [d for d, size in enumerate(ctx.shape(node)) if ctx.static(size) and size > 1]
    for d in range(len(src)):
        for s in ctx.shard_options(x, d):
            mapped = map_view_dim(src, dst, d, s.parts(ctx.world))
            if s.whole(ctx.world) and s.chunks is None and static:  # every rank holds all: any static dim
                mapped = (mapped[0] if mapped and mapped[0] in static else static[-1], True)
            if s.chunks is not None and not (mapped and mapped[1]):
                rows = (
                    _in_rows(s, src, dst, d, ctx.world)
                    or _per_block(s, src, dst, d, ctx.world)
                    or _merged_blocks(s, src, dst, d, ctx.world)
                )
                found += [Strategy(ctx.fill(node, {x: s}), rows)] if rows else []
                continue
            if mapped is None:
                continue
            if ctx.static(ctx.shape(node)[mapped[0]]):
                found.append(Strategy(ctx.fill(node, {x: s}), s.at(mapped[0])))
    return found


def _in_rows(shard: Shard, src: list, dst: list, d: int, world: int) -> Shard | None:
    """A block-wise shard of a dim that the view splits into (rows, ...): the same pieces counted in rows,
    if every rank's pieces are whole rows (Falcon's qkv, [H heads | k | v] x head dim, viewed as heads)."""
    for dim, out, rest in split_runs(src, dst):
        if dim == d and all(c % rest == 0 for c in shard.chunks):
            rows = replace(shard, dim=out, chunks=tuple(c // rest for c in shard.chunks))
            if _scaled_alike(rows, shard, src[d] // rest, rest, world):
                return rows
    return None


def _merged_blocks(shard: Shard, src: list, dst: list, d: int, world: int) -> Shard | None:
    """A block-wise shard of the first dim of a run the view merges into one: the same blocks, each counted in
    the merged dim (heads of two kinds joined, [b, s, 2 + 2, d] viewed as [b, s, 4 * d]), where every rank's
    pieces stay whole runs of the merged dims."""
    if shard.of is not None or shard.groups is not None:
        return None
    for dim, out, rest in merged_runs(src, dst):
        if dim == d and rest > 1:
            merged = replace(shard, dim=out, chunks=tuple(c * rest for c in shard.chunks))
            if _scaled_alike(shard, merged, src[d], rest, world):
                return merged
    return None


def _scaled_alike(coarse: Shard, fine: Shard, size: int, rest: int, world: int) -> bool:
    """Every rank's pieces of ``coarse`` (a dim of ``size``), each ``rest`` times longer, are its pieces of
    ``fine`` (the dim of size * rest the view makes of it, or made it from)."""
    return all(
        [(a * rest, n * rest) for a, n in coarse.ranges(size, r, world)] == fine.ranges(size * rest, r, world)
        for r in range(world)
    )


def _per_block(shard: Shard, src: list, dst: list, d: int, world: int) -> Shard | None:
    """k equal blocks of a fused dim viewed as (k, heads, ...), each split alike: the shard of the heads dim
    (BLIP's and ModernBERT's qkv, [3 x heads x head dim] viewed as [3, heads, head dim])."""
    for dim, out, rest in split_runs(src, dst):
        size = src[d]
        if dim != d or dst[out] != len(shard.chunks) or set(shard.chunks) != {rest} or out + 1 >= len(dst):
            continue
        heads = dst[out + 1]
        inner = rest // heads
        one = shard.block(0, rest, world)
        if one.chunks is not None or (one.units is not None and heads % one.units and one.units % heads):
            continue
        found = replace(one, dim=out + 1, units=None if one.units is None else min(one.units, heads))
        if all(
            shard.ranges(size, r, world)
            == [(k * rest + a * inner, n * inner) for k in range(dst[out]) for a, n in found.ranges(heads, r, world)]
            for r in range(world)
        ):
            return found
    return None
