"""Sharding rules: one small function per op family, looked up in RULES by ATen op.

A rule returns the sharded strategies it is sure of; the all-replicated one is
always added by the caller.  An op missing from RULES is computed replicated,
which is always correct.  Nothing here looks at module or model names.
"""
from __future__ import annotations

import itertools
import operator

import torch
from torch.fx import Node

from autotp.runtime.placement import P, R, Shard

from .expert_rules import DISJOINT_OPS, EXPERT_RULES, disjoint
from .layout_rules import (
    cat,
    expand,
    getitem,
    index_copy,
    permute,
    positive_dim,
    slice_,
    split,
    t,
    transpose,
    unsqueeze,
    view,
    whole_spellings,
)
from .strategies import ADDITIVE, Context, Strategy, contractible, input_slots, is_placed

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
            placements = {a: _aligned(shard, ctx.shape(a), d - (len(out) - len(ctx.shape(a))), out[d], ctx)
                          for a in _tensor_inputs(node)}
            if None not in placements.values():
                found.append(Strategy(ctx.fill(node, placements), shard))
    return found + _partial(node, ctx)


def _same_dtype(node: Node) -> bool:
    src = node.args[0].meta.get("val")
    return src is not None and src.dtype == node.meta["val"].dtype


# Ops linear in their partial operand(s): sum_r f(p_r) == f(sum_r p_r).
_LINEAR_UNARY = {aten.neg.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
                 aten.detach.default}
_CASTS = {aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default}
# which operand may be the partial one
_SCALING = {aten.mul.Tensor: (0, 1), aten.div.Tensor: (0,), aten.mul.Scalar: (0,)}


def _partial(node: Node, ctx: Context) -> list[Strategy]:
    tensors = _tensor_inputs(node)
    target = node.target
    if target in _LINEAR_UNARY or (target in _CASTS and _same_dtype(node)):
        return [Strategy(ctx.fill(node, {tensors[0]: P}), P)]
    if target == aten.dropout.default and node.args[2] is False:
        return [Strategy(ctx.fill(node, {tensors[0]: P}), P)]
    if target in ADDITIVE and len(tensors) == len(node.args[:2]) and len(set(tensors)) == len(tensors):
        # both partial; or one partial and the other replicated, added by one rank (strategies.adds_once)
        return [Strategy(ctx.fill(node, dict.fromkeys(tensors, P)), P),
                *(Strategy(ctx.fill(node, {a: P}), P) for a in tensors)]
    if target in _SCALING:
        found = []
        for i in _SCALING[target]:
            a = node.args[i]
            if isinstance(a, Node) and is_placed(a) and tensors.count(a) == 1:
                found.append(Strategy(ctx.fill(node, {a: P}), P))
        return found
    return []


# ---- matrix products -----------------------------------------------------------------------

def linear(node: Node, ctx: Context) -> list[Strategy]:
    """Megatron's column split (weight rows) and row split (weight columns -> partial sums)."""
    x, w = node.args[0], node.args[1]
    assert len(node.args) < 3 or node.args[2] is None, "bias is split off by passes.decompose"
    out = ctx.shape(node)
    last, xlast = len(out) - 1, len(ctx.shape(x)) - 1
    found = [Strategy(ctx.fill(node, {w: s.at(0)}), s) for s in ctx.shard_options(node, last)]
    for s in contractible(ctx.output_options(x) + ctx.shard_options(x, xlast), xlast, ctx.world):
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
    for d in range(n - 2):  # batch dims, right-aligned against each operand
        for s in ctx.shard_options(node, d):
            if s.chunks is None:
                placements = {t: _aligned(s, shape[:-2], d - (n - len(shape)), out[d], ctx)
                              for t, shape in ((a, sa), (b, sb))}
                if None not in placements.values():
                    found.append(Strategy(ctx.fill(node, placements), s))
    return found


def attention(node: Node, ctx: Context) -> list[Strategy]:
    """scaled_dot_product_attention split by heads (dim 1); GQA needs both head counts divisible.  A single
    KV head that attention broadcasts to every query head (Falcon's multi-query) is read whole: replicated,
    or held whole by every rank (its gradient then partial sums, like the query heads' shares)."""
    q, k, v = node.args[:3]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    heads = ctx.shape(q)[1]
    found = []
    for s in ctx.shard_options(node, 1):
        if s.chunks is not None:
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


def repeat_heads(node: Node, ctx: Context) -> list[Strategy]:
    """x.repeat_interleave(n, dim) (grouped-query attention's KV heads): each rank's output heads need
    only the KV heads they repeat, which it holds replicated, sharded, shared with neighbours, or whole
    (a single KV head every rank holds, named on any dim)."""
    x, repeats, at = node.args[:3]
    kv, heads = ctx.shape(x)[at], ctx.shape(node)[at]
    whole = [s for d in range(len(ctx.shape(x))) if d != at for s in ctx.shard_options(x, d) if s.whole(ctx.world)]
    found = [Strategy(ctx.fill(node, {x: P}), P)]
    for out in ctx.shard_options(node, at):
        for src in [R, *ctx.shard_options(x, at), *whole]:
            if out.chunks is None and getattr(src, "chunks", None) is None and all(
                    _covers(held_heads(src, at, kv, r, ctx.world), out, heads, repeats, r, ctx.world)
                    for r in range(ctx.world)):
                found.append(Strategy(ctx.fill(node, {x: src}), out))
    return found


def held_heads(src, at: int, kv: int, rank: int, world: int) -> tuple[int, int]:
    """(first, count) of the ``kv`` heads along ``at`` that a rank holds in placement ``src``."""
    if isinstance(src, Shard) and src.dim == at:
        return src.ranges(kv, rank, world)[0]
    return 0, kv


def _covers(held: tuple[int, int], out: Shard, heads: int, repeats: int, rank: int, world: int) -> bool:
    (first, count), = out.ranges(heads, rank, world)
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
    found = [Strategy(ctx.fill(node, {x: P}), P)]
    for d in range(n):
        for s in ctx.shard_options(x, d) + [s for s in ctx.token_options(x, d) if d not in dims]:
            if d not in dims:
                od = d if keep else d - sum(1 for r in dims if r < d)
                found.append(Strategy(ctx.fill(node, {x: s}), s.at(od)))
            elif not s.grouped(ctx.world) and (node.target == aten.sum.dim_IntList or all(
                    ctx.static(ctx.shape(x)[r]) for r in dims)):  # a mean: local sum / full count
                found.append(Strategy(ctx.fill(node, {x: s}), P))
    return found


def normalize(node: Node, ctx: Context) -> list[Strategy]:
    """softmax / layer_norm: any dim outside the normalized ones may stay sharded."""
    x = node.args[0]
    n = len(ctx.shape(x))
    if node.target == aten.layer_norm.default:
        normed = set(range(n - len(node.args[1]), n))
    else:
        normed = {positive_dim(node.args[1], n)}
    found = []
    for d in range(n):
        if d not in normed:
            found += [Strategy(ctx.fill(node, {x: s}), s) for s in ctx.shard_options(x, d) + ctx.token_options(x, d)]
    return found


_POINTWISE = [
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.neg.default, aten.pow.Tensor_Scalar,
    aten.rsqrt.default, aten.sqrt.default, aten.exp.default, aten.tanh.default, aten.sigmoid.default,
    aten.silu.default, aten.gelu.default, aten.relu.default, aten.erf.default, aten.abs.default,
    aten.cos.default, aten.sin.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
    aten.detach.default, aten.dropout.default, aten.where.self, aten.masked_fill.Scalar, aten.eq.Tensor,
    aten.ne.Tensor, aten.lt.Tensor, aten.gt.Tensor, aten.le.Tensor, aten.ge.Tensor, aten.mul.Scalar,
    aten.add.Scalar, *_CASTS,
]

RULES = {
    **dict.fromkeys(_POINTWISE, pointwise),
    aten.linear.default: linear,
    **dict.fromkeys([aten.mm.default, aten.bmm.default, aten.matmul.default], matmul),
    aten.scaled_dot_product_attention.default: attention,
    aten.embedding.default: embedding,
    aten.repeat_interleave.self_int: repeat_heads,
    **dict.fromkeys([aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints],
                    view),
    **dict.fromkeys([aten.expand.default, aten.broadcast_to.default], expand),
    aten.transpose.int: transpose,
    aten.permute.default: permute,
    **dict.fromkeys([aten.t.default, aten.numpy_T.default], t),
    aten.unsqueeze.default: unsqueeze,
    **dict.fromkeys([aten.slice.Tensor, aten.select.int], slice_),  # index.Tensor: expert_rules.index
    **dict.fromkeys([aten.sum.dim_IntList, aten.mean.dim], reduction),
    **dict.fromkeys([aten._softmax.default, aten.softmax.int, aten._log_softmax.default,
                     aten.log_softmax.int, aten.layer_norm.default], normalize),
    **dict.fromkeys([aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default], split),
    operator.getitem: getitem,
    **dict.fromkeys([aten.index_copy_.default, aten.index_copy.default], index_copy),
    **dict.fromkeys([aten.cat.default, aten.stack.default], cat),
    **EXPERT_RULES,  # mixture-of-experts layouts (3-D expert weights); its strided slice extends slice_
}
# rules that add to an op's own (expert parallelism's disjoint partials carried through it)
MORE_RULES = dict.fromkeys(DISJOINT_OPS, disjoint)
