"""Sharding rules for mixture-of-experts layouts: expert weights as 3-D parameters ``[E, out, in]``.

Experts are computed where they are stored, in one of two ways the solver prices against each other.
Expert parallelism deals whole experts out to the ranks (``S(0)``, or ``S(0/E)`` unevenly: 6 experts on 4
ranks hold 2,2,1,1): a rank computes the rows routed to its own experts and zeros elsewhere, a disjoint
partial sum ``D`` (placement.py), which ops mapping 0 to 0 carry on (silu, products of rows routed alike)
until the all-reduce the layer needs anyway sums it -- the all-reduce variant of Megatron's expert
parallelism, without token dispatch.  Expert tensor parallelism (Megatron's) keeps every expert on
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

import operator

import torch
from torch.fx import Node

from autotp.ops.layout_rules import constant_positions, cut_range, gather, mapped, positive_dim, slice_
from autotp.ops.strategies import Context, Strategy, contractible, input_slots, is_placed, value
from autotp.placement import Disjoint, P, R, Routed, Shard, simplest

aten = torch.ops.aten
# transformers registers its op when its MoE integration is imported; rules find it by name
GROUPED_MM_FALLBACK = "transformers.grouped_mm_fallback.default"


def offsets(node: Node):
    """A grouped matmul's ``offs`` (each expert's rows end there: tokens sorted by expert)."""
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")


def is_grouped_mm(node: Node) -> bool:
    return node.target == aten._grouped_mm.default or str(node.target) == GROUPED_MM_FALLBACK


def grouped_mm(node: Node, ctx: Context) -> list[Strategy]:
    """``x[S, K] @ w[e]`` for the rows of each expert group e: split N (w's last dim; the output's columns),
    or contract a split K (x's columns and w's rows: partial sums); a partial x gives partial outputs.
    Or whole experts (w's dim 0): this rank's experts' rows, from x whole or from x's rows computed by the
    same experts under the same offsets (a disjoint partial)."""
    x, w = node.args[0], node.args[1]
    bias = node.args[3] if len(node.args) > 3 else node.kwargs.get("bias")
    if len(ctx.shape(x)) != 2 or len(ctx.shape(w)) != 3 or bias is not None or offsets(node) is None:
        return []
    found = []
    if ctx.experts in (None, "tensor"):
        found += [Strategy(ctx.fill(node, {w: s.at(2)}), s) for s in ctx.shard_options(node, 1)]
        for s in contractible(ctx.output_options(x) + ctx.shard_options(x, 1), 1, ctx.world):
            if s in ctx.shard_options(w, 1):
                found.append(Strategy(ctx.fill(node, {x: s, w: s}), P))
    for s, out in _whole_experts(w, ctx):
        found.append(Strategy(ctx.fill(node, {w: s}), out))
        if out in ctx.output_options(x) and routing(x, ctx) == routing(node, ctx):
            found.append(Strategy(ctx.fill(node, {x: out, w: s}), out))
    found.append(Strategy(ctx.fill(node, {x: P}), P))
    return found


def _whole_experts(w: Node, ctx: Context) -> list[tuple[Shard, Disjoint]]:
    """Ways to deal out whole experts (``w``'s dim 0), each to one rank, and the disjoint partial sums
    that computing with them gives; none when another expert strategy is imposed, nor when a mesh's "ep" dim
    dispatches the experts (whole experts over TP then hold rows of experts dealt over "ep")."""
    if ctx.experts in ("tensor", "all-to-all") or ctx.ep > 1:
        return []
    count = ctx.shape(w)[0]
    return [
        (s, Disjoint(simplest(s.at(0), count, ctx.world)))
        for s in ctx.shard_options(w, 0)
        if s.chunks is None and not s.grouped(ctx.world) and not s.whole(ctx.world)
    ]


def integer_indices(indices) -> bool:
    """Integer index tensors on the leading dims, one dim each.  Not None entries (``x[:, ids]`` moves
    dims around) nor boolean masks (one mask consumes as many dims as it has)."""
    return bool(indices) and all(
        isinstance(i, Node) and isinstance(value(i), torch.Tensor) and value(i).dtype in (torch.int64, torch.int32)
        for i in indices
    )


def index(node: Node, ctx: Context) -> list[Strategy] | None:
    """Positions that are a constant run (Falcon's ``heads[..., [-2], :]``) cut like a slice; otherwise
    ``x[i0, i1, ...]`` with index tensors on x's leading dims: the other dims keep their shard (moved
    behind the index's dims), a partial x stays partial; the indices are read whole."""
    if cut_range(node) is not None:
        return slice_(node, ctx)
    if constant_positions(node) is not None:
        return gather(node, ctx)
    x, indices = node.args[0], node.args[1]
    lead = next((i for i, index in enumerate(indices) if index is not None), 0)
    if lead and integer_indices(indices[lead:]):
        return _past_whole_dims(node, ctx, lead)
    if not integer_indices(indices):
        ctx.why[node] = "indexed by positions known only at run time: computed whole, its inputs gathered"
        return None
    k, n, out = len(indices), len(ctx.shape(x)), len(ctx.shape(node))
    shift = out - n  # x dim d (d >= k) is output dim d + shift: the indices' dims replace x's first k
    found = [Strategy(ctx.fill(node, {x: P}), P)]
    experts = _whole_experts(x, ctx) if routing(node, ctx) is not None else []
    found += [Strategy(ctx.fill(node, {x: s}), d) for s, d in experts]  # one expert's rows per routed token
    imposed = routing(node, ctx) is not None and ctx.experts in ("parallel", "all-to-all")
    for d in range(n if imposed else k, n):
        found += [
            Strategy(ctx.fill(node, {x: s}), s.at(d + shift))
            for s in ctx.shard_options(x, d)
            if ctx.shape(node)[d + shift] == ctx.shape(x)[d]
        ]
    return found


def _past_whole_dims(node: Node, ctx: Context, lead: int) -> list[Strategy]:
    """``x[:, ids]`` (LeViT's ``attention_biases[:, idxs]``, a [heads, offsets] table read as [heads, n, n]): the
    whole dims before the indexed ones keep their place and shard, the dims after them move behind the index's."""
    x, indices = node.args[0], node.args[1]
    k, n = len(indices) - lead, len(ctx.shape(x))
    shift = len(ctx.shape(node)) - n
    found = [Strategy(ctx.fill(node, {x: P}), P)]
    for d in [*range(lead), *range(lead + k, n)]:
        at = d if d < lead else d + shift
        found += [
            Strategy(ctx.fill(node, {x: s}), s.at(at))
            for s in ctx.shard_options(x, d)
            if ctx.shape(node)[at] == ctx.shape(x)[d]
        ]
    return found


def squeeze(node: Node, ctx: Context) -> list[Strategy]:
    n = len(ctx.shape(node.args[0]))
    at = positive_dim(node.args[1], n)
    if ctx.shape(node.args[0])[at] != 1:
        return mapped(node, ctx, lambda d: d)  # squeezing a dim that is not 1 keeps the shape
    return mapped(node, ctx, lambda d: None if d == at else d - (d > at))


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
            for r in range(ctx.world)
        ):
            found.append(Strategy(ctx.fill(node, {x: s}), out))
    return found


def routing(node: Node, ctx: Context) -> tuple[Node, int] | None:
    """What routed ``node``'s rows to experts, where its rows come from an expert op through ops that keep
    rows (their rows' ``experts``): (a grouped matmul's offsets, or the ids of a weight's lookup ``w[ids]``;
    the number of experts).  Two disjoint partials of one routing hold the same rows on the same rank (when
    their experts are dealt alike: the same shard of the same number of experts).  Memoized in ctx.routes."""
    if node not in ctx.routes:
        ctx.routes[node] = _routing(node, ctx) if isinstance(node, Node) and node.op == "call_function" else None
    return ctx.routes[node]


def _routing(node: Node, ctx: Context) -> tuple[Node, int] | None:
    if is_grouped_mm(node):
        return offsets(node), value(node.args[1]).shape[0]
    if node.target == aten.index.Tensor:
        ids, weight = node.args[1], node.args[0]
        while weight.op == "call_function" and ctx.op(weight.target).layout:
            weight = weight.args[0]
        found = len(ids) == 1 and integer_indices(ids) and weight.op == "get_attr"
        return (ids[0], value(node.args[0]).shape[0]) if found else None
    kind = ctx.op(node.target).experts
    if kind in ("zeros", "rows") or node.target is operator.getitem:
        return routing(node.args[0], ctx)
    if kind == "combine":
        found = {routing(a, ctx) for a in node.args[:2]} - {None}
        return found.pop() if len(found) == 1 else None
    return None


def _keeps_rows(node: Node, ctx: Context) -> bool:
    """Whether a layout op leaves dim 0 (the routed rows) alone: it splits, cuts or adds another dim."""
    if ctx.op(node.target).experts != "rows":
        return True
    splits = ctx.op(node.target).family == "split"
    at = node.args[2 if splits else 1] if len(node.args) > (2 if splits else 1) else node.kwargs.get("dim", 0)
    shaped = node if node.target == aten.unsqueeze.default else node.args[0]
    return positive_dim(at, len(value(shaped).shape)) != 0


def disjoint(node: Node, ctx: Context) -> list[Strategy]:
    """A disjoint partial through ops that keep it one: zero-keeping ops and row-keeping layout ops of it;
    its product with a whole tensor; the sum or product of two routed alike (same routing, same experts)."""
    if (
        ctx.experts in ("tensor", "all-to-all")
        or ctx.ep > 1
        or not _keeps_rows(node, ctx)
        or routing(node, ctx) is None
    ):
        return []

    def held(a: Node) -> list:
        return [p for p in ctx.output_options(a) if isinstance(p, Disjoint)] if isinstance(a, Node) else []

    if ctx.op(node.target).experts != "combine":
        x = node.args[0]
        count = len(value(node)) if isinstance(value(node), (list, tuple)) else None
        return [Strategy(ctx.fill(node, {x: d}), d if count is None else (d,) * count) for d in held(x)]
    shape = ctx.shape(node)
    options = {
        a: held(a)
        for a in node.args[:2]
        if isinstance(a, Node)
        and is_placed(a)  # rows not broadcast
        and len(ctx.shape(a)) == len(shape)
        and ctx.probe(ctx.shape(a)[0]) == ctx.probe(shape[0])
    }
    a, b = node.args[:2]
    found = []
    alike = a is not b and routing(a, ctx) == routing(b, ctx)
    for d in dict.fromkeys([*options.get(a, []), *options.get(b, [])]):
        if node.target != aten.add.Tensor:  # a product: the other operand may be whole
            found += [Strategy(ctx.fill(node, {x: d}), d) for x in (a, b) if d in options.get(x, [])]
        if alike and d in options.get(a, []) and d in options.get(b, []):
            found.append(Strategy(ctx.fill(node, {a: d, b: d}), d))
    return found


def routed(node: Node, ctx: Context) -> list[Strategy]:
    """Expert parallelism by all-to-all: a node of an expert segment (ops/expert_segments.py) run by the owners of
    the experts on the rows routed to them (``A``: whole experts dealt over the dispatch group, the TP group
    times a mesh's "ep" dim), reading the routing key whole.  Only ops that keep rows (an owner holds a subset
    of them): expert products, lookups by the ids, ops mapped row by row; and layout ops of the tables that
    leave the experts' dim alone."""
    segment = ctx.segments.get(node)
    ranks = ctx.world * ctx.ep
    if (
        segment is None
        or ctx.experts in ("tensor", "parallel")
        or ranks < 2
        or segment.experts < ranks
        or node.op != "call_function"
    ):
        return []
    held = Routed(simplest(Shard(0, units=segment.experts), segment.experts, ranks), ranks)
    if node in segment.views:
        dims = (
            [positive_dim(d, len(ctx.shape(node))) for d in node.args[1:3]] if node.target == aten.transpose.int else []
        )
        kept = ctx.op(node.target).family == "elementwise" or (dims and 0 not in dims)
        return [Strategy(ctx.fill(node, {node.args[0]: held}), held)] if kept else []
    if node not in segment.nodes or not _row_wise(node, segment, ctx):
        return []
    count = len(value(node)) if isinstance(value(node), (list, tuple)) else None
    inputs = {a: R if a is segment.key else held for a in input_slots(node) if is_placed(a)}
    return [Strategy(ctx.fill(node, inputs), held if count is None else (held,) * count)]


def _row_wise(node: Node, segment, ctx: Context) -> bool:
    if is_grouped_mm(node) or "row_wise" in ctx.op(node.target).tags:
        return True
    if node.target == aten.index.Tensor:
        return node.args[1] == [segment.key]
    return ctx.op(node.target).experts in ("zeros", "rows", "combine") and _keeps_rows(node, ctx)
