"""Sharding rules of compute ops: one small function per op family (the op table, ops/table.py, says
which op uses which).

A rule returns the sharded strategies it is sure of; the all-replicated one is always added by the caller.
An op without a rule is computed replicated, which is always correct.  Nothing here looks at module or model
names.
"""

from __future__ import annotations

import itertools

import torch
from torch.fx import Node

from autotp.ops.layout_rules import einsum_terms, positive_dim, whole_spellings
from autotp.ops.strategies import Context, Strategy, contractible, input_slots, is_placed, summable
from autotp.placement import P, R, Shard

aten = torch.ops.aten


def _tensor_inputs(node: Node) -> list[Node]:
    return [s for s in input_slots(node) if is_placed(s)]


# ---- elementwise ---------------------------------------------------------------------------


def _aligned(shard: Shard, shape: tuple, ad: int, size: int, ctx: Context):
    """An input's placement when the output dim it aligns with (``ad``, right-aligned; of ``size``) is
    sharded: the same shard where the sizes are equal, R where it broadcasts (absent or of size 1);
    None where that is not known (a symbolic size): then the output dim cannot be sharded."""
    if ad < 0 or (ctx.static(shape[ad]) and shape[ad] == 1):
        return R
    if not ctx.static(size):  # a token dim: the operand's equal symbolic size follows it
        return shard.at(ad) if not ctx.static(shape[ad]) and ctx.probe(shape[ad]) == ctx.probe(size) else None
    return shard.at(ad) if ctx.static(shape[ad]) and shape[ad] == size else None


def pointwise(node: Node, ctx: Context) -> list[Strategy]:
    """Shard any output dim; each input shards the aligned dim, or stays R where it broadcasts."""
    out = ctx.shape(node)
    found = []
    for d in range(len(out)):
        for shard in ctx.shard_options(node, d) + ctx.token_options(node, d):
            placements = {
                a: _aligned(shard, ctx.shape(a), d - (len(out) - len(ctx.shape(a))), out[d], ctx)
                for a in _tensor_inputs(node)
            }
            if None not in placements.values():
                found.append(Strategy(ctx.fill(node, placements), shard))
    return found + _partial(node, ctx)


def dropout(node: Node, ctx: Context) -> list[Strategy]:
    """Pointwise; a training dropout not split so that two ranks hold overlapping pieces that differ: each piece's
    mask is drawn by the ranks that hold it (runtime/dropout.py), so ranks sharing only part of one would mask
    the shared part differently."""
    found = pointwise(node, ctx)
    if not node.args[2]:
        return found
    return [
        s
        for s in found
        if not isinstance(s.output, Shard) or separate_pieces(s.output, ctx.shape(node)[s.output.dim], ctx.world)
    ]


def separate_pieces(shard: Shard, size, world: int) -> bool:
    """Every two ranks hold the same piece of ``shard`` (``size`` long) or pieces that do not overlap."""
    if not isinstance(size, int):
        return shard.units is None and shard.chunks is None  # a token dim: N slices
    cells = [
        frozenset(i for start, n in shard.ranges(size, r, world) for i in range(start, start + n)) for r in range(world)
    ]
    return all(a == b or not a & b for a, b in itertools.combinations(cells, 2))


def _real_or_complex(node: Node) -> bool:
    v = node.meta.get("val")
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def _partial(node: Node, ctx: Context) -> list[Strategy]:
    """Partial sums through an op linear in them (its row's ``linear`` operands, one at a time); a sum of two
    partial sums, or of a partial sum and a replicated operand that one rank adds (its row's ``additive``)."""
    tensors = _tensor_inputs(node)
    if not all(_real_or_complex(a) for a in tensors):
        return []  # a mask or an index is no sum of parts
    row = ctx.op(node.target)
    if row.additive and len(tensors) == len(node.args[:2]) and len(set(tensors)) == len(tensors):
        return [
            Strategy(ctx.fill(node, dict.fromkeys(tensors, P)), P),
            *(Strategy(ctx.fill(node, {a: P}), P) for a in tensors),
        ]
    if row.linear_if is not None and not row.linear_if(node):
        return []
    found = []
    for i in row.linear:
        a = node.args[i] if i < len(node.args) else None
        if isinstance(a, Node) and is_placed(a) and tensors.count(a) == 1:
            found.append(Strategy(ctx.fill(node, {a: P}), P))
    return found


# ---- matrix products -----------------------------------------------------------------------


def linear(node: Node, ctx: Context) -> list[Strategy]:
    """Megatron's column split (weight rows) and row split (weight columns -> partial sums)."""
    x, w = node.args[0], node.args[1]
    assert len(node.args) < 3 or node.args[2] is None, "bias is split off before the rules (split_bias)"
    out = ctx.shape(node)
    last, xlast = len(out) - 1, len(ctx.shape(x)) - 1
    found = [Strategy(ctx.fill(node, {w: s.at(0)}), s) for s in ctx.shard_options(node, last)]
    for s in contractible(ctx.output_options(x) + ctx.shard_options(x, xlast), xlast, ctx.world, blocks=True):
        found.append(Strategy(ctx.fill(node, {x: s, w: s.at(1)}), P))
    found.append(Strategy(ctx.fill(node, {x: P}), P))
    for d in range(last):
        found += [Strategy(ctx.fill(node, {x: s}), s) for s in ctx.shard_options(node, d) if s.chunks is None]
    return found


def matmul(node: Node, ctx: Context) -> list[Strategy]:
    """mm / bmm / matmul: batch dims, columns of b, rows of a, or the contraction (partial)."""
    a, b = node.args[0], node.args[1]
    out, sa, sb = ctx.shape(node), ctx.shape(a), ctx.shape(b)
    n = len(out)
    if len(sa) < 2 or len(sb) < 2:
        return []
    found = [Strategy(ctx.fill(node, {b: s.at(len(sb) - 1)}), s) for s in ctx.shard_options(node, n - 1)]
    found += [Strategy(ctx.fill(node, {a: s.at(len(sa) - 2)}), s) for s in ctx.shard_options(node, n - 2)]
    k = len(sa) - 1  # contracted: a static dim (never tokens), evenly or by whole heads, as linear
    for s in contractible(ctx.output_options(a) + ctx.shard_options(a, k), k, ctx.world) if ctx.static(sa[-1]) else ():
        found.append(Strategy(ctx.fill(node, {a: s, b: s.at(len(sb) - 2)}), P))
    found += [Strategy(ctx.fill(node, {a: P}), P), Strategy(ctx.fill(node, {b: P}), P)]
    for d in range(n - 2):  # batch dims, right-aligned against each operand, in any layout both share
        for s in ctx.shard_options(node, d):
            placements = {
                t: _aligned(s, shape[:-2], d - (n - len(shape)), out[d], ctx) for t, shape in ((a, sa), (b, sb))
            }
            if None not in placements.values():
                found.append(Strategy(ctx.fill(node, placements), s))
    return found


def attention(node: Node, ctx: Context) -> list[Strategy]:
    """scaled_dot_product_attention split by heads (dim 1), in blocks too (DiffLlama's halves of heads, each
    split alike); GQA needs both head counts divisible.  A single
    KV head that attention broadcasts to every query head (Falcon's multi-query) is read whole: replicated,
    or held whole by every rank (its gradient then partial sums, like the query heads' shares)."""
    q, k, v = node.args[:3]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    heads = ctx.shape(q)[1]
    found = []
    for s in ctx.shard_options(node, 1):  # block by block where keys and values are laid out alike
        if s.chunks is not None and not all(ctx.shape(t)[1] == heads for t in (k, v)):
            continue
        for pk, pv in itertools.product(_kv_reads(k, s, heads, ctx), _kv_reads(v, s, heads, ctx)):
            if k is v and pk != pv:
                continue
            placements = {q: s, k: pk, v: pv}
            if isinstance(mask, Node):
                mshape = ctx.shape(mask)
                placements[mask] = s if len(mshape) == 4 and mshape[1] == heads else R
            found.append(Strategy(ctx.fill(node, placements), s))
    return found


def _kv_reads(kv: Node, s: Shard, heads: int, ctx: Context) -> list:
    """How attention split by query heads as ``s`` may read a key or value: split alike, or whole where
    it is one head broadcast to all."""
    if s in ctx.shard_options(kv, 1):
        return [s]
    if ctx.shape(kv)[1] == 1 and ctx.static(heads) and heads > 1:
        return [R, *whole_spellings(kv, ctx)]
    return []


def embedding(node: Node, ctx: Context) -> list[Strategy]:
    """Split the hidden dim of the table (every rank looks up its slice of every row), or the
    vocabulary (Megatron: ids outside a rank's rows give zeros; partial sums)."""
    weight = node.args[0]
    last = len(ctx.shape(node)) - 1
    found = [Strategy(ctx.fill(node, {weight: s.at(1)}), s) for s in ctx.shard_options(node, last) if s.chunks is None]
    rows = contractible(ctx.shard_options(weight, 0), 0, ctx.world)
    found += [Strategy(ctx.fill(node, {weight: s}), P) for s in rows]
    return found


def repeat_interleave(node: Node, ctx: Context) -> list[Strategy]:
    """x.repeat_interleave(n, dim) (grouped-query attention's KV heads): each rank's output heads need
    only the KV heads they repeat, which it holds replicated, sharded, shared with neighbours, or whole
    (a single KV head every rank holds, named on any dim)."""
    x, repeats, at = node.args[:3]
    kv, heads = ctx.shape(x)[at], ctx.shape(node)[at]
    whole = [s for d in range(len(ctx.shape(x))) if d != at for s in ctx.shard_options(x, d) if s.whole(ctx.world)]
    found = [Strategy(ctx.fill(node, {x: P}), P)]
    for out in ctx.shard_options(node, at):
        for src in [R, *ctx.shard_options(x, at), *whole]:
            if (
                out.chunks is None
                and getattr(src, "chunks", None) is None
                and all(
                    _covers(held_heads(src, at, kv, r, ctx.world), out, heads, repeats, r, ctx.world)
                    for r in range(ctx.world)
                )
            ):
                found.append(Strategy(ctx.fill(node, {x: src}), out))
    return found


def held_heads(src, at: int, kv: int, rank: int, world: int) -> tuple[int, int]:
    """(first, count) of the ``kv`` heads along ``at`` that a rank holds in placement ``src``."""
    if isinstance(src, Shard) and src.dim == at:
        return src.ranges(kv, rank, world)[0]
    return 0, kv


def _covers(held: tuple[int, int], out: Shard, heads: int, repeats: int, rank: int, world: int) -> bool:
    ((first, count),) = out.ranges(heads, rank, world)
    start, length = held
    return start <= first // repeats and (first + count - 1) // repeats < start + length


def reduction(node: Node, ctx: Context) -> list[Strategy]:
    """sum/mean over dims: other dims keep their shard; reducing a sharded dim gives a partial sum
    (RMSNorm's mean of squares over a sharded hidden dim: one tiny all-reduce)."""
    x = node.args[0]
    n = len(ctx.shape(x))
    dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else list(range(n))
    dims = sorted(positive_dim(d, n) for d in dims)
    keep = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
    found = [Strategy(ctx.fill(node, {x: P}), P)] if summable(x) else []
    for d in range(n):
        for s in ctx.shard_options(x, d) + [s for s in ctx.token_options(x, d) if d not in dims]:
            if d not in dims:
                od = d if keep else d - sum(1 for r in dims if r < d)
                found.append(Strategy(ctx.fill(node, {x: s}), s.at(od)))
            elif not s.grouped(ctx.world) and (
                node.target == aten.sum.dim_IntList or all(ctx.static(ctx.shape(x)[r]) for r in dims)
            ):  # a mean: local sum / full count
                found.append(Strategy(ctx.fill(node, {x: s}), P))
    return found


def normalize(node: Node, ctx: Context) -> list[Strategy]:
    """softmax / layer_norm / rms_norm / cumsum: any dim outside the normalized (scanned) ones may stay sharded."""
    x = node.args[0]
    n = len(ctx.shape(x))
    if ctx.op(node.target).family == "layer_norm":  # layer_norm / rms_norm(x, normalized_shape, ...)
        normed = set(range(n - len(node.args[1]), n))
    else:
        normed = {positive_dim(node.args[1], n)}
    found = []
    for d in range(n):
        if d not in normed:
            found += [Strategy(ctx.fill(node, {x: s}), s) for s in ctx.shard_options(x, d) + ctx.token_options(x, d)]
    return found


def pad(node: Node, ctx: Context) -> list[Strategy]:
    """Padding: a dim it pads nothing on may stay sharded (the widths name dims from the last, two per dim; a
    width computed from a size, such as padding to a multiple of a chunk, counts as padding)."""
    x, widths = node.args[0], node.args[1]
    n = len(ctx.shape(x))
    padded = {n - 1 - i // 2 for i, width in enumerate(widths) if not (isinstance(width, int) and width == 0)}
    return [
        Strategy(ctx.fill(node, {x: s}), s)
        for d in range(n)
        if d not in padded
        for s in ctx.shard_options(x, d) + ctx.token_options(x, d)
    ]


def einsum(node: Node, ctx: Context) -> list[Strategy]:
    """einsum by its letters (no ellipsis, no repeated letter, no operand twice): a letter the output keeps may
    be split in every operand that has it (the others read whole), block by block too (the copies of tiled KV
    heads: every operand's blocks split alike); a contracted letter split in every operand
    that has it sums partial products; one partial operand, the others whole, gives a partial result (the
    product is linear in each operand)."""
    found_terms = einsum_terms(node)
    if found_terms is None:
        return []
    (terms, kept), operands = found_terms, node.args[1]
    inputs = "".join(terms)
    out = ctx.shape(node)
    found = []
    for d, letter in enumerate(kept):
        for s in ctx.shard_options(node, d) + ctx.token_options(node, d):
            placements = {
                x: _aligned(s, ctx.shape(x), term.index(letter), out[d], ctx) if letter in term else R
                for term, x in zip(terms, operands, strict=True)
            }
            if None not in placements.values():
                found.append(Strategy(ctx.fill(node, placements), s))
    for letter in dict.fromkeys(c for c in inputs if c.isalpha() and c not in kept):
        holders = [(x, term.index(letter)) for term, x in zip(terms, operands, strict=True) if letter in term]
        (first, k), size = holders[0], ctx.shape(holders[0][0])[holders[0][1]]
        if not ctx.static(size) or any(ctx.shape(x)[j] != size for x, j in holders):
            continue
        for s in contractible(ctx.shard_options(first, k), k, ctx.world):
            found.append(Strategy(ctx.fill(node, {x: s.at(j) for x, j in holders}), P))
    return found + [Strategy(ctx.fill(node, {x: P}), P) for x in operands]


def top_k(node: Node, ctx: Context) -> list[Strategy]:
    """topk: a dim other than the one ranked stays sharded in both outputs (values and indices)."""
    x = node.args[0]
    n = len(ctx.shape(x))
    at = positive_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1), n)  # topk(x, k, dim)
    return [
        Strategy(ctx.fill(node, {x: s}), (s, s))
        for d in range(n)
        if d != at
        for s in ctx.shard_options(x, d) + ctx.token_options(x, d)
    ]
