"""Sharding rules for mixture-of-experts layouts: expert weights as 3-D parameters ``[E, out, in]``.

Experts are computed where they are stored.  Expert tensor parallelism (Megatron's) keeps every expert on
every rank and splits each one like a dense MLP: gate/up by output rows, down by input columns, so the
expert outputs are partial sums and the layer needs one all-reduce.  The ops that carry such a shard:
  grouped matmuls  ``grouped_mm(x[S, K], w[E, K, N], offs)`` (torch's ``_grouped_mm`` and transformers'
                   ``grouped_mm_fallback``, its export-friendly twin): N split, or K split -> partial sums;
  index            ``w[expert_ids]`` (one weight per routed token, then ``bmm``): the other dims keep
                   their shard, a partial sum stays one (gathering rows is linear);
  squeeze          the ``bmm`` helper dims;
  strided slices   interleaved gate/up columns ``h[..., ::2]`` / ``h[..., 1::2]``: only a shard whose every
                   rank holds whole pairs (checked rank by rank) passes, else the slice is replicated.
"""
from __future__ import annotations

import torch
from torch.fx import Node

from autotp.runtime.placement import P, Shard, simplest

from .layout_rules import _mapped, constant_positions, cut_range, gather, positive_dim, slice_
from .strategies import Context, Strategy, contractible, value

aten = torch.ops.aten
# transformers registers its op when its MoE integration is imported; rules find it by name
GROUPED_MM_FALLBACK = "transformers.grouped_mm_fallback.default"


def grouped_mm(node: Node, ctx: Context) -> list[Strategy]:
    """``x[S, K] @ w[e]`` for the rows of each expert group e: split N (w's last dim; the output's columns),
    or contract a split K (x's columns and w's rows: partial sums); a partial x gives partial outputs."""
    x, w = node.args[0], node.args[1]
    bias = node.args[3] if len(node.args) > 3 else node.kwargs.get("bias")
    if len(ctx.shape(x)) != 2 or len(ctx.shape(w)) != 3 or bias is not None:
        return []
    found = [Strategy(ctx.fill(node, {w: s.at(2)}), s) for s in ctx.shard_options(node, 1)]
    for s in contractible(ctx.output_options(x) + ctx.shard_options(x, 1), 1, ctx.world):
        if s in ctx.shard_options(w, 1):
            found.append(Strategy(ctx.fill(node, {x: s, w: s}), P))
    found.append(Strategy(ctx.fill(node, {x: P}), P))
    return found


def _integer_indices(indices) -> bool:
    """Integer index tensors on the leading dims, one dim each.  Not None entries (``x[:, ids]`` moves
    dims around) nor boolean masks (one mask consumes as many dims as it has)."""
    return bool(indices) and all(isinstance(i, Node) and isinstance(value(i), torch.Tensor) and
                                 value(i).dtype in (torch.int64, torch.int32) for i in indices)


def index(node: Node, ctx: Context) -> list[Strategy] | None:
    """Positions that are a constant run (Falcon's ``heads[..., [-2], :]``) cut like a slice; otherwise
    ``x[i0, i1, ...]`` with index tensors on x's leading dims: the other dims keep their shard (moved
    behind the index's dims), a partial x stays partial; the indices are read whole."""
    if cut_range(node) is not None:
        return slice_(node, ctx)
    if constant_positions(node) is not None:
        return gather(node, ctx)
    x, indices = node.args[0], node.args[1]
    if not _integer_indices(indices):
        return None  # no rule: replicated, and said
    k, n, out = len(indices), len(ctx.shape(x)), len(ctx.shape(node))
    shift = out - n  # x dim d (d >= k) is output dim d + shift: the indices' dims replace x's first k
    found = [Strategy(ctx.fill(node, {x: P}), P)]
    for d in range(k, n):
        found += [Strategy(ctx.fill(node, {x: s}), s.at(d + shift)) for s in ctx.shard_options(x, d)
                  if ctx.shape(node)[d + shift] == ctx.shape(x)[d]]
    return found


def squeeze(node: Node, ctx: Context) -> list[Strategy]:
    n = len(ctx.shape(node.args[0]))
    at = positive_dim(node.args[1], n)
    if ctx.shape(node.args[0])[at] != 1:
        return _mapped(node, ctx, lambda d: d)  # squeezing a dim that is not 1 keeps the shape
    return _mapped(node, ctx, lambda d: None if d == at else d - (d > at))


def strided_slice(node: Node, ctx: Context) -> list[Strategy]:
    """``x[..., start::step]`` over a whole dim (interleaved gate/up columns): a shard passes when every
    rank's pieces start and end on a multiple of ``step``, so it holds whole groups of ``step`` and its
    slice is exactly its share of the output.  Step-1 slices and select go to layout_rules.slice_."""
    found = slice_(node, ctx)
    x = node.args[0]
    shape = ctx.shape(x)
    at = positive_dim(node.args[1] if len(node.args) > 1 else 0, len(shape))
    start, end, step = [*node.args[2:5], None, None, 1][:3]
    size = shape[at]
    if step == 1 or not all(isinstance(v, int) for v in (start, step, size)) or not 0 <= start < step:
        return found
    if (end is not None and end < size) or size % step:
        return found
    for s in ctx.shard_options(x, at):
        if s.chunks is not None:
            continue
        out = simplest(Shard(at, units=s.units, of=s.of), size // step, ctx.world)
        pieces = [s.ranges(size, r, ctx.world) for r in range(ctx.world)]
        if all(a % step == 0 and n % step == 0 for ranks in pieces for a, n in ranks) and all(
                out.ranges(size // step, r, ctx.world) == [(a // step, n // step) for a, n in pieces[r]]
                for r in range(ctx.world)):
            found.append(Strategy(ctx.fill(node, {x: s}), out))
    return found


def hint_sources(node: Node, dim: int, ctx: Context) -> list[tuple[Node, int]]:
    """Where a block hint on ``(node, dim)`` (gate|up cut by chunk) came from, so the expert weight itself
    is offered the block-wise shard: through a grouped matmul's or bmm's output columns to the weight's,
    a bmm's rows to its first operand's, and through transposes, squeezes and ``w[ids]``."""
    target, args, n = node.target, node.args, len(ctx.shape(node))
    if target in (aten._grouped_mm.default, aten.bmm.default) or str(target) == GROUPED_MM_FALLBACK:
        if dim == n - 1:
            return [(args[1], len(ctx.shape(args[1])) - 1)]
        return [(args[0], 1)] if target == aten.bmm.default and dim == 1 else []
    if target == aten.transpose.int:
        a, b = positive_dim(args[1], n), positive_dim(args[2], n)
        return [(args[0], {a: b, b: a}.get(dim, dim))]
    if target == aten.squeeze.dim:
        at = positive_dim(args[1], len(ctx.shape(args[0])))
        return [(args[0], dim + (dim >= at))] if ctx.shape(args[0])[at] == 1 else [(args[0], dim)]
    if target == aten.index.Tensor and _integer_indices(args[1]):
        d = dim - n + len(ctx.shape(args[0]))
        return [(args[0], d)] if d >= len(args[1]) else []
    return []


EXPERT_RULES = {
    aten._grouped_mm.default: grouped_mm,
    GROUPED_MM_FALLBACK: grouped_mm,
    aten.index.Tensor: index,
    aten.squeeze.dim: squeeze,
    aten.slice.Tensor: strided_slice,
}
