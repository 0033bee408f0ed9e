"""Sharding rules for layout ops: transposes, slices, splits, concatenation, in-place writes (view and reshape:
ops/view_rules.py).  Each maps a shard of the input to the output dim that carries the same data; ops/table.py says
which op uses which.
"""

from __future__ import annotations

import operator
from dataclasses import replace

import torch
from torch.fx import Node

from autotp.ops.semantics import written
from autotp.ops.strategies import Context, Strategy, concrete, summable
from autotp.placement import P, Shard, dealt

aten = torch.ops.aten


def positive_dim(d: int, ndim: int) -> int:
    """A dim index counted from the front (negative dims count from the back)."""
    return d + ndim if d < 0 else d


def einsum_terms(node: Node):
    """(each operand's letters, the output's letters) of an einsum the rules read: no ellipsis, no repeated
    letter, no operand twice; else None."""
    equation, operands = node.args[0], node.args[1]
    if not isinstance(equation, str) or "." in equation or "->" not in equation:
        return None
    inputs, kept = equation.replace(" ", "").split("->")
    terms = inputs.split(",")
    if (
        len(terms) != len(operands)
        or not all(isinstance(x, Node) for x in operands)
        or len(set(operands)) != len(operands)
        or any(len(set(t)) != len(t) for t in [*terms, kept])
    ):
        return None
    return terms, kept


def mapped(node: Node, ctx: Context, dim_map) -> list[Strategy]:
    """Single-input layout ops, from a function input dim -> output dim (None: may not be sharded)."""
    x = node.args[0]
    found = [Strategy(ctx.fill(node, {x: P}), P)] if summable(x) else []
    for d, size in enumerate(ctx.shape(x)):
        od = dim_map(d)
        if od is not None and ctx.shape(node)[od] == size:
            found += [Strategy(ctx.fill(node, {x: s}), s.at(od)) for s in ctx.shard_options(x, d)]
    return found


def as_complex(node: Node, ctx: Context) -> list[Strategy]:
    """view_as_complex: the trailing (real, imaginary) dim of 2 goes, every other dim keeps its shard (a shard of
    the pairs' dim holds whole pairs); linear over the reals, so partial sums pass."""
    pairs = len(ctx.shape(node.args[0])) - 1
    return mapped(node, ctx, lambda d: None if d == pairs else d)


def as_real(node: Node, ctx: Context) -> list[Strategy]:
    """view_as_real: every dim keeps its shard; the new trailing (real, imaginary) dim is whole."""
    return mapped(node, ctx, lambda d: d)


def expand(node: Node, ctx: Context) -> list[Strategy]:
    offset = len(ctx.shape(node)) - len(ctx.shape(node.args[0]))
    return mapped(node, ctx, lambda d: d + offset)


def transpose(node: Node, ctx: Context) -> list[Strategy]:
    n = len(ctx.shape(node))
    a, b = positive_dim(node.args[1], n), positive_dim(node.args[2], n)
    return mapped(node, ctx, lambda d: {a: b, b: a}.get(d, d))


def permute(node: Node, ctx: Context) -> list[Strategy]:
    n = len(ctx.shape(node))
    order = [positive_dim(d, n) for d in node.args[1]]
    return mapped(node, ctx, lambda d: order.index(d))


def t(node: Node, ctx: Context) -> list[Strategy]:
    return mapped(node, ctx, lambda d: 1 - d if len(ctx.shape(node)) == 2 else d)


def unsqueeze(node: Node, ctx: Context) -> list[Strategy]:
    at = positive_dim(node.args[1], len(ctx.shape(node)))
    return mapped(node, ctx, lambda d: d if d < at else d + 1)


def cut_range(node: Node) -> tuple[int, int, int] | None:
    """(dim, start, end) of the step-1 range of a static dim that a slice cuts out (bounds counted from the
    end when negative, clamped to the size), or an index by a constant run of positions (Falcon's
    ``qkv[..., [-2], :]``); else None."""
    shape = [concrete(size) for size in node.args[0].meta["val"].shape]
    if node.target == aten.index.Tensor:
        return _constant_run(node, shape)
    if node.target != aten.slice.Tensor:
        return None
    at = positive_dim(node.args[1] if len(node.args) > 1 else 0, len(shape))
    start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
    end = node.args[3] if len(node.args) > 3 and node.args[3] is not None else shape[at]
    step = node.args[4] if len(node.args) > 4 else 1
    if step != 1 or not all(isinstance(v, int) for v in (start, end, shape[at])):
        return None
    start, end = (min(max(v + shape[at] if v < 0 else v, 0), shape[at]) for v in (start, end))
    return (at, start, end) if start < end else None


def _constant_run(node: Node, shape: list) -> tuple[int, int, int] | None:
    """x[..., [a, a+1, ..., b-1], ...] with the positions a constant tensor of the graph: (dim, a, b).
    Refused where the result is written in place (a slice, which the rewrite may use, would alias x)."""
    found = constant_positions(node)
    if found is None or written(node):
        return None
    at, run = found
    return (at, run[0], run[-1] + 1) if run == list(range(run[0], run[0] + len(run))) else None


def constant_positions(node: Node) -> tuple[int, list[int]] | None:
    """(dim, positions) of ``x[..., positions, ...]`` indexing one static dim by a constant 1-D tensor of the
    graph (negative positions counted from the end); None if they are known only at run time (or on meta)."""
    if node.target != aten.index.Tensor:
        return None
    shape = [concrete(size) for size in node.args[0].meta["val"].shape]
    indices = node.args[1]
    given = [d for d, index in enumerate(indices) if index is not None]
    if len(given) != 1 or not isinstance(shape[given[0]], int):
        return None
    at, source = given[0], indices[given[0]]
    if source.target == aten.lift_fresh_copy.default:
        source = source.args[0]
    if source.op != "get_attr" or source.graph.owning_module is None:
        return None
    values = operator.attrgetter(source.target)(source.graph.owning_module)
    if (
        not isinstance(values, torch.Tensor)
        or values.is_meta
        or values.dim() != 1
        or not len(values)
        or values.dtype not in (torch.int64, torch.int32)
    ):
        return None
    positions = [v + shape[at] if v < 0 else v for v in values.tolist()]
    return (at, positions) if all(0 <= v < shape[at] for v in positions) else None


def gather(node: Node, ctx: Context) -> list[Strategy] | None:
    """x[..., positions, ...] by constant positions that are no run (cuts of [groups, q|k|v] heads read as
    one gather, canonicalize/group_cuts.py): other dims keep their shard; along the indexed dim each rank's output
    reads only positions its own piece holds -- checked rank by rank, so any layout that passes is exact."""
    found = constant_positions(node)
    if found is None or written(node):
        return None
    at, positions = found
    x, size = node.args[0], len(positions)
    strategies = mapped(node, ctx, lambda d: None if d == at else d)
    for s in ctx.shard_options(x, at):
        outs = ctx.shard_options(node, at)
        if s.of == size and dealt(size, ctx.world):  # the finer units the input's pieces follow, dealt whole
            outs = [*outs, Shard(at, units=size)]
        strategies += [
            Strategy(ctx.fill(node, {x: s}), o)
            for o in dict.fromkeys(outs)
            if o.chunks is None
            and all(gathered(s, o, positions, ctx.shape(x)[at], r, ctx.world) is not None for r in range(ctx.world))
        ]
    return strategies


def gathered(held: Shard, out: Shard, positions: list[int], size: int, rank: int, world: int) -> list[int] | None:
    """The positions in this rank's piece (laid out as ``held``, of a dim of ``size``) that its share of the
    output (``out``) reads, or None if it does not hold them all."""
    local, offset = {}, 0
    for start, length in held.ranges(size, rank, world):
        local.update({start + i: offset + i for i in range(length)})
        offset += length
    wanted = [positions[start + i] for start, length in out.ranges(len(positions), rank, world) for i in range(length)]
    return [local[p] for p in wanted] if all(p in local for p in wanted) else None


def block_of(shard: Shard, start: int, end: int) -> int | None:
    """Which block of a fused dim the range [start, end) is exactly, if any."""
    offset = 0
    for k, block in enumerate(shard.chunks if shard.groups is None else ()):  # a repeated block is not one range
        if (start, end) == (offset, offset + block):
            return k
        offset += block
    return None


def whole_spellings(node: Node, ctx: Context) -> list[Shard]:
    """The ways to name "every rank holds all of it" on ``node`` (one per dim that may carry it)."""
    return [s for d in range(len(ctx.shape(node))) for s in ctx.shard_options(node, d) if s.whole(ctx.world)]


def slice_(node: Node, ctx: Context) -> list[Strategy] | None:
    """Slicing (or indexing by a constant run, see cut_range) along an unsharded dim (select drops that
    dim); or cutting one whole block out of a fused dim sharded block by block (Phi-3's qkv[..., a:b],
    Falcon's heads[..., [-2], :]), which leaves a plain shard, or one every rank holds whole."""
    x = node.args[0]
    n = len(ctx.shape(x))
    bounds = cut_range(node)
    if node.target == aten.index.Tensor and bounds is None:
        return None  # positions known only at run time: no rule (replicated, and said)
    at = bounds[0] if bounds else positive_dim(node.args[1] if len(node.args) > 1 else 0, n)
    drop = node.target == aten.select.int
    found = mapped(node, ctx, lambda d: None if d == at else (d - 1 if drop and d > at else d))
    if bounds:
        for s in ctx.shard_options(x, at):
            k = block_of(s, bounds[1], bounds[2]) if s.chunks else None
            if k is not None:
                out = s.block(k, s.chunks[k], ctx.world)
                outs = (whole_spellings(node, ctx) or [out]) if out.whole(ctx.world) else [out]
                found += [Strategy(ctx.fill(node, {x: s}), o) for o in outs]
            elif s.whole(ctx.world) and bounds[2] - bounds[1] > 1:  # a piece of what every rank holds
                found.append(Strategy(ctx.fill(node, {x: s}), s))
    return found


def split(node: Node, ctx: Context) -> list[Strategy]:
    """split / split_with_sizes / chunk: a fused dim sharded block by block gives plain shards."""
    x = node.args[0]
    n = len(ctx.shape(x))
    at = positive_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), n)
    sizes = tuple(o.shape[at] for o in node.meta["val"])
    k = len(sizes)
    # chunk(n) recomputes piece sizes from the local size: only equal pieces stay aligned; pieces of a
    # dynamic size (a sequence chunked) are not known to line up with any shard
    split_dim_ok = all(isinstance(v, int) for v in sizes) and (
        node.target != aten.chunk.default or len(set(sizes)) == 1
    )
    found = [Strategy(ctx.fill(node, {x: P}), (P,) * k)] if summable(x) else []
    for d in range(n):
        for s in ctx.shard_options(x, d):
            if d != at and s.chunks is None:
                found.append(Strategy(ctx.fill(node, {x: s}), (s,) * k))
            elif d == at and split_dim_ok and s.chunks == sizes and s.groups is None:
                found.append(
                    Strategy(ctx.fill(node, {x: s}), tuple(s.block(i, n, ctx.world) for i, n in enumerate(sizes)))
                )
            elif d == at and split_dim_ok and k == 1 and s.chunks is None:
                found.append(Strategy(ctx.fill(node, {x: s}), (s,)))
            elif d == at and split_dim_ok and s.chunks and s.groups is None:
                pieces = refined(s, sizes, ctx.world)  # pieces of several blocks each
                found += [Strategy(ctx.fill(node, {x: s}), pieces)] if pieces else []
    return found


def pieces_of(chunks: tuple, sizes) -> list[list[int]] | None:
    """Which fused blocks make up each piece a split cuts (the blocks' indices, in order), if whole blocks do."""
    found, k = [], 0
    for size in sizes:
        taken, total = [], 0
        while total < size and k < len(chunks):
            taken.append(k)
            total += chunks[k]
            k += 1
        if total != size:
            return None
        found.append(taken)
    return found if k == len(chunks) else None


def refined(shard: Shard, sizes: tuple, world: int) -> tuple | None:
    """The layout of each piece of a split whose pieces are runs of whole blocks of ``shard`` (the in_proj_weight
    of cross-attention, S(0|E,E,E), split into [q | kv]: S(0) and S(0|E,E))."""
    pieces = pieces_of(shard.chunks, sizes)
    if pieces is None:
        return None
    units = shard.units if isinstance(shard.units, tuple) else (shard.units,) * len(shard.chunks)
    return tuple(
        shard.block(ks[0], shard.chunks[ks[0]], world)
        if len(ks) == 1
        else replace(
            shard,
            chunks=tuple(shard.chunks[k] for k in ks),
            units=None if shard.units is None else tuple(units[k] for k in ks),
        )
        for ks in pieces
    )


def indexed(node: Node, ctx: Context) -> list[Strategy]:
    """x.index_select(dim, index) and x.index_copy_(dim, index, source) (a KV cache read through block tables and
    written at its positions or slots): any other dim may be sharded alike in x, the source and the output; the index
    stays whole."""
    x, at = node.args[:2]
    source = node.args[3] if len(node.args) > 3 else None
    at = positive_dim(at, len(ctx.shape(x)))
    found = []
    for d in range(len(ctx.shape(x))):
        if d != at and (source is None or ctx.shape(source)[d] == ctx.shape(x)[d]):
            found += [
                Strategy(ctx.fill(node, {x: s, **({source: s} if source is not None else {})}), s)
                for s in ctx.shard_options(x, d)
            ]
    return found


def getitem(node: Node, ctx: Context) -> list[Strategy]:
    """Pick one output of a multi-output op; it follows whatever its producer chose."""
    source, index = node.args
    return [
        Strategy(ctx.fill(node, {source: option}), option[index])
        for option in ctx.output_options(source)
        if isinstance(option, tuple)
    ]


def cat(node: Node, ctx: Context) -> list[Strategy]:
    """cat / stack of parts sharded alike on another dim (stack: those after its new dim move up one; GPT-J's
    rotary, ``torch.stack((-x2, x1), dim=-1)``), or on the joined dim where every rank holds all of it; cat of
    parts each split on the joined dim into a dim fused block by block (split's inverse)."""
    n = len(ctx.shape(node))
    at = positive_dim(node.args[1] if len(node.args) > 1 else 0, n)
    stacked = node.target == aten.stack.default
    parts = node.args[0]
    if not stacked and n > 1:  # cat skips a 1-D empty part (XLM's cache starts as torch.empty(0)): it stays R
        parts = [p for p in parts if not (isinstance(p, Node) and [str(d) for d in ctx.shape(p)] == ["0"])]
    found = []
    if parts and all(isinstance(p, Node) for p in parts) and len(set(parts)) == len(parts):
        found += [Strategy(ctx.fill(node, dict.fromkeys(parts, P)), P)] if all(map(summable, parts)) else []
        for d in range(n):  # whole on the joined dim: every rank holds all of it
            found += [
                Strategy(ctx.fill(node, dict.fromkeys(parts, s.at(d - (stacked and d > at)))), s)
                for s in ctx.shard_options(node, d)
                if d != at or (s.chunks is None and s.whole(ctx.world) and not stacked)
            ]
        sizes = tuple(ctx.shape(p)[at] if len(ctx.shape(p)) == n else None for p in parts)
        if not stacked and all(isinstance(v, int) for v in sizes):  # split's inverse: each part a block
            found += [
                Strategy(
                    ctx.fill(
                        node, {p: s.block(k, v, ctx.world) for k, (p, v) in enumerate(zip(parts, sizes, strict=True))}
                    ),
                    s,
                )
                for s in ctx.shard_options(node, at)
                if s.chunks == sizes and s.groups is None
            ]
    return found


def unbind(node: Node, ctx: Context) -> list[Strategy]:
    """unbind: a dim other than the one taken apart stays sharded in every piece (the dims after it move down
    one); partial sums stay partial (rotary's ``x1, x2 = x.unbind(-1)`` on heads split)."""
    x = node.args[0]
    n = len(ctx.shape(x))
    at = positive_dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), n)
    k = len(node.meta["val"])
    found = [Strategy(ctx.fill(node, {x: P}), (P,) * k)] if summable(x) else []
    for d in range(n):
        for s in ctx.shard_options(x, d) if d != at else ():  # blocks too: each piece keeps them
            found.append(Strategy(ctx.fill(node, {x: s}), (s.at(d - (d > at)),) * k))
    return found
