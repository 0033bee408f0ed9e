"""Dim maps: which input dim an output dim's blocks come from, per op (the op table's ``dim_map`` column).

A hint found downstream -- a fused [q|k|v] cut into blocks, a dim of heads -- walks back through the ops that
produced the value (passes/hints.py) so that the parameter it started from is offered the same blocks.  Each
map takes ``(node, dim, blocks, ctx)`` and returns ``[(input, its dim, its blocks)]``; an op without one stops
the walk.  DTensor's ``dim_maps`` play the same part for its view ops.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from autotp.ops.channel_rules import conv_groups
from autotp.ops.expert_rules import integer_indices
from autotp.ops.layout_rules import einsum_terms, pieces_of, positive_dim
from autotp.ops.strategies import Context, is_placed
from autotp.ops.views import inverse_view_dim, split_runs

aten = torch.ops.aten


def view(node: Node, dim: int, blocks, ctx: Context) -> list:
    """The input dim the output dim was viewed from; a dim of heads split off a flat dim, the flat dim."""
    src = [ctx.probe(s) for s in ctx.shape(node.args[0])]
    dst = [ctx.probe(s) for s in ctx.shape(node)]
    found = []
    d = inverse_view_dim(src, dst, dim)
    if d is not None:
        found.append((node.args[0], d, blocks))
    return found + [
        (node.args[0], d, in_flat_units(blocks, rest)) for d, out, rest in split_runs(src, dst) if out == dim
    ]


def t(node: Node, dim: int, blocks, ctx: Context) -> list:
    return [(node.args[0], 1 - dim if len(ctx.shape(node)) == 2 else dim, blocks)]


def matmul(node: Node, dim: int, blocks, ctx: Context) -> list:
    """``x @ w.t()``: the output's columns are the second operand's; a batch dim (heads) is each operand's that
    has it, broadcast from the right."""
    out = ctx.shape(node)
    if dim == len(out) - 1 and len(ctx.shape(node.args[1])) >= 2:
        return [(node.args[1], len(ctx.shape(node.args[1])) - 1, blocks)]
    if dim >= len(out) - 2:
        return []
    return [
        (a, ad, blocks)
        for a in node.args[:2]
        if isinstance(a, Node)
        for ad in [dim - len(out) + len(ctx.shape(a))]
        if 0 <= ad < len(ctx.shape(a)) - 2 and ctx.shape(a)[ad] == out[dim]
    ]


def bmm(node: Node, dim: int, blocks, ctx: Context) -> list:
    """Columns from the second operand's, rows (dim 1) from the first's."""
    return matmul(node, dim, blocks, ctx) or ([(node.args[0], 1, blocks)] if dim == 1 else [])


def grouped(node: Node, dim: int, blocks, ctx: Context) -> list:
    """A grouped matmul's output columns are its expert weights' columns."""
    if dim == len(ctx.shape(node)) - 1:
        return [(node.args[1], len(ctx.shape(node.args[1])) - 1, blocks)]
    return []


def linear(node: Node, dim: int, blocks, ctx: Context) -> list:
    """The output's features are the weight's rows (a view of a parameter's, split apart)."""
    return [(node.args[1], 0, blocks)] if dim == len(ctx.shape(node)) - 1 else []


def unsqueeze(node: Node, dim: int, blocks, ctx: Context) -> list:
    at = positive_dim(node.args[1], len(ctx.shape(node)))
    return [(node.args[0], dim - (dim > at), blocks)] if dim != at else []


def transpose(node: Node, dim: int, blocks, ctx: Context) -> list:
    n = len(ctx.shape(node))
    a, b = positive_dim(node.args[1], n), positive_dim(node.args[2], n)
    return [(node.args[0], {a: b, b: a}.get(dim, dim), blocks)]


def permute(node: Node, dim: int, blocks, ctx: Context) -> list:
    order = node.args[1]
    return [(node.args[0], positive_dim(order[dim], len(ctx.shape(node))), blocks)]


def squeeze(node: Node, dim: int, blocks, ctx: Context) -> list:
    at = positive_dim(node.args[1], len(ctx.shape(node.args[0])))
    return (
        [(node.args[0], dim + (dim >= at), blocks)]
        if ctx.shape(node.args[0])[at] == 1
        else [(node.args[0], dim, blocks)]
    )


def index(node: Node, dim: int, blocks, ctx: Context) -> list:
    """``w[ids]``: the dims after the indexed ones are the table's own."""
    if not integer_indices(node.args[1]):
        return []
    d = dim - len(ctx.shape(node)) + len(ctx.shape(node.args[0]))
    return [(node.args[0], d, blocks)] if d >= len(node.args[1]) else []


def elementwise(node: Node, dim: int, blocks, ctx: Context) -> list:
    """Every operand that has the dim, broadcast from the right."""
    out = ctx.shape(node)
    found = []
    for a in node.all_input_nodes:
        shape = ctx.shape(a) if is_placed(a) else ()
        ad = dim - (len(out) - len(shape))
        if ad >= 0 and shape[ad] == out[dim]:
            found.append((a, ad, blocks))
    return found


def getitem(node: Node, dim: int, blocks, ctx: Context) -> list:
    """One piece of an unbind: that dim of the unbound tensor.  One piece of a split: that piece's blocks among
    the other pieces, for the split tensor
    (nn.MultiheadAttention's cross-attention: in_proj_weight cut into [q | kv], kv cut into [k | v])."""
    parts, index = node.args
    if ctx.op(parts.target).family == "unbind":  # one slice of an unbind: the unbound tensor's other dims
        unbound = parts.args[0]
        at = positive_dim(parts.args[1] if len(parts.args) > 1 else parts.kwargs.get("dim", 0), len(ctx.shape(unbound)))
        return [(unbound, dim + (dim >= at), blocks)]
    if ctx.op(parts.target).family != "split":
        return []
    x = parts.args[0]
    at = positive_dim(parts.args[2] if len(parts.args) > 2 else parts.kwargs.get("dim", 0), len(ctx.shape(x)))
    sizes = [o.shape[at] for o in parts.meta["val"]]
    if (
        dim != at
        or isinstance(blocks, int)
        or not all(isinstance(c, int) for c in blocks)
        or sum(blocks) != sizes[index]
    ):
        return []
    return [(x, at, (*sizes[:index], *blocks, *sizes[index + 1 :]))]


def slice_(node: Node, dim: int, blocks, ctx: Context) -> list:
    """A slice or select keeps the dims it does not cut (a causal conv's padding cut off the sequence)."""
    at = positive_dim(node.args[1] if len(node.args) > 1 else 0, len(ctx.shape(node.args[0])))
    if node.target == aten.select.int:
        return [(node.args[0], dim + (dim >= at), blocks)]
    return [(node.args[0], dim, blocks)] if dim != at else []


def convolution(node: Node, dim: int, blocks, ctx: Context) -> list:
    """Output channels are the weight's rows, and a depthwise conv's input channels too."""
    if dim != 1:
        return []
    depthwise = conv_groups(node) == ctx.shape(node.args[0])[1] != 1
    return [(node.args[1], 0, blocks)] + ([(node.args[0], 1, blocks)] if depthwise else [])


def cat(node: Node, dim: int, blocks, ctx: Context) -> list:
    """Every part has the dims a cat does not join; on the joined dim, blocks that end where parts end are
    each part's own (q | k | v concatenated, then cut again after a conv)."""
    parts = [p for p in node.args[0] if isinstance(p, Node)]
    at = positive_dim(node.args[1] if len(node.args) > 1 else 0, len(ctx.shape(node)))
    if node.target == aten.stack.default:
        return [(p, dim - (dim > at), blocks) for p in parts] if dim != at else []
    if dim != at:
        return [(p, dim, blocks) for p in parts]
    if (
        isinstance(blocks, int)
        or not all(isinstance(b, int) for b in blocks)
        or len(parts) != len(node.args[0])
        or any(len(ctx.shape(p)) != len(ctx.shape(node)) for p in parts)
    ):
        return []
    pieces = pieces_of(tuple(blocks), [ctx.shape(p)[at] for p in parts])
    return [(p, at, tuple(blocks[k] for k in ks)) for p, ks in zip(parts, pieces or (), strict=False) if len(ks) > 1]


def einsum(node: Node, dim: int, blocks, ctx: Context) -> list:
    """A letter the output keeps is every operand's that has it at the same size."""
    found = einsum_terms(node)
    if found is None:
        return []
    (terms, kept), size = found, ctx.shape(node)[dim]
    return [
        (x, term.index(kept[dim]), blocks)
        for term, x in zip(terms, node.args[1], strict=True)
        if kept[dim] in term and ctx.shape(x)[term.index(kept[dim])] == size
    ]


def in_flat_units(hint, rest: int):
    """A hint on a heads dim, for the flat dim the heads were viewed from (blocks ``rest`` times longer)."""
    if isinstance(hint, int):
        return hint  # a unit count
    if isinstance(hint[0], int):
        return tuple(c * rest for c in hint)  # block sizes
    chunks, *units = hint  # units per block, and the finer units and groups they follow, if any
    return tuple(c * rest for c in chunks), *units


def attention(node: Node, dim: int, blocks, ctx: Context) -> list:
    """Attention's heads are its query's, and its keys' and values' where they have as many (DiffLlama's two
    halves of heads, each value head repeated over both)."""
    out = ctx.shape(node)
    return [
        (a, 1, blocks)
        for a in node.args[:3]
        if dim == 1 and isinstance(a, Node) and len(ctx.shape(a)) == len(out) and ctx.shape(a)[1] == out[1]
    ]


BY_FAMILY = {
    "view": view,
    "t": t,
    "matmul": matmul,
    "unsqueeze": unsqueeze,
    "linear": linear,
    "getitem": getitem,
    "elementwise": elementwise,
    "transpose": transpose,
    "grouped_mm": grouped,
    "permute": permute,
    "slice": slice_,
    "convolution": convolution,
    "cat": cat,
    "attention": attention,
    "einsum": einsum,
    "softmax": elementwise,
    "log_softmax": elementwise,
}
