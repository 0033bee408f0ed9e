"""Heads merged with the batch, moved on past the ops that treat every [B*H] row alike.

A view of [B, H, ...] as [B*H, ...] hides the heads from the rules.  Each op between such a merge and the product
or view that ends it is rewritten on [B, H, ...] with the merge after it, until the merge meets a view back to
[B, H, ...] (then it is gone) or a product (passes/unmerge.py's merged_products rewrites that): ops over later dims
(softmax, dropout, a cast, an unsqueeze, a transpose), elementwise ops of merges alike, an einsum whose merged letter
only that operand and the output lead with, a view of the later dims.  SAM's and ViTDet's decomposed relative
positions are all of these: ``q.reshape(B*H, h, w, c)`` in two einsums, unsqueezed, added, viewed as [B, H, N, N].
A pick of q, k and v from [3, B*H, ...] is made from [3, B, H, ...] and merged after (merged_picks).
"""
from __future__ import annotations

import math
import operator
import string

import torch
from torch.fx import Node

from autotp.ops.strategies import Context
from autotp.ops.table import op
from autotp.passes.prepare import call

aten = torch.ops.aten


def sizes_of(ctx: Context, node: Node) -> list[int]:
    return [ctx.probe(s) for s in ctx.shape(node)]


def flattens_heads(node: Node) -> bool:
    return node.target == aten.flatten.using_ints and tuple(node.args[1:3]) == (0, 1)


def merges_heads(node: Node, ctx: Context) -> bool:
    """``node`` views a [B, H, ...] tensor as [B*H, ...]."""
    if not (flattens_heads(node) or "sized_view" in op(node.target).tags) or not isinstance(node.args[0], Node):
        return False
    inner, outer = sizes_of(ctx, node.args[0]), sizes_of(ctx, node)
    return len(inner) == len(outer) + 1 > 2 and inner[0] * inner[1] == outer[0] and inner[2:] == outer[1:] \
        and 1 not in inner[:2]


def merged_picks(gm: torch.fx.GraphModule, ctx: Context) -> None:
    """``x.reshape(k, B*H, ...)`` of x [k, B, H, ...] picked apart on its first dim (``unbind(0)``, ``select``)
    =>  the picks of x, each merged (SAM: ``qkv.reshape(3, B*H, N, d).unbind(0)``)."""
    graph = gm.graph
    for view in list(graph.nodes):
        if "sized_view" not in op(view.target).tags or not isinstance(view.args[0], Node):
            continue
        x = view.args[0]
        inner, outer = sizes_of(ctx, x), sizes_of(ctx, view)
        if not (len(inner) == len(outer) + 1 > 3 and inner[0] == outer[0] and inner[1] * inner[2] == outer[1]
                and inner[3:] == outer[2:] and 1 not in inner[1:3] and view.users and all(
                    _first_dim_pick(u) for u in view.users)):
            continue
        merged = list(view.args[1][1:])
        with graph.inserting_before(view):
            for user in list(view.users):
                if user.target == aten.select.int:
                    picked = [(user, call(graph, aten.select.int, (x, 0, user.args[2]), user))]
                else:
                    parts = call(graph, aten.unbind.int, (x, 0), user)
                    picked = [(g, call(graph, operator.getitem, (parts, g.args[1]), g)) for g in user.users]
                for old, new in picked:
                    old.replace_all_uses_with(call(graph, aten.reshape.default, (new, merged), old))
                    graph.erase_node(old)
                if user.graph is graph and not user.users:
                    graph.erase_node(user)
        graph.erase_node(view)


def _first_dim_pick(node: Node) -> bool:
    if node.target == aten.select.int:
        return node.args[1] == 0
    return node.target == aten.unbind.int and (len(node.args) < 2 or node.args[1] == 0) and all(
        u.target is operator.getitem for u in node.users)


def merged_rows(gm: torch.fx.GraphModule, ctx: Context) -> None:
    """Each merge's readers rewritten on the unmerged value where they can be (_moved), the merge after them."""
    graph = gm.graph
    todo = [node for node in graph.nodes if merges_heads(node, ctx)]
    while todo:
        merge = todo.pop(0)
        if merge.graph is not graph or not merges_heads(merge, ctx):
            continue
        for user in list(merge.users):
            if user.graph is not graph:
                continue
            with graph.inserting_before(user):
                made = _moved(graph, merge, user, ctx)
            if made is None:
                continue
            operands = user.all_input_nodes
            user.replace_all_uses_with(made)
            graph.erase_node(user)
            for other in operands:  # another merge this op read, now read by none
                if other is not merge and other.graph is graph and not other.users and merges_heads(other, ctx):
                    graph.erase_node(other)
            if merges_heads(made, ctx):
                todo.append(made)
        if not merge.users:
            graph.erase_node(merge)


def _moved(graph: torch.fx.Graph, merge: Node, user: Node, ctx: Context) -> Node | None:
    """``user`` of ``merge`` computed on the unmerged [B, H, ...] value, merged after; None where it cannot be."""
    x = merge.args[0]
    unmerged = sizes_of(ctx, x)
    if "sized_view" in op(user.target).tags and user.args[0] is merge:
        return _view(graph, merge, user, ctx)
    if user.target == aten.einsum.default:
        return _einsum(graph, merge, user, ctx)
    dims = _row_dims(user, len(unmerged) - 1)
    if dims is None or user.args[0] is not merge or merge in user.kwargs.values():
        return None
    args = list(user.args)
    for i in dims:
        args[i] = args[i] + 1 if args[i] >= 0 else args[i]
    for i, a in enumerate(args[1:], 1):
        if isinstance(a, Node):  # another operand: a merge alike, or one broadcast over the rows
            same = _alike(a, merge, ctx)
            if not (same or (isinstance(a.meta.get("val"), torch.Tensor) and (
                    a.meta["val"].dim() < len(unmerged) - 1 or sizes_of(ctx, a)[0] == 1))):
                return None
            args[i] = a.args[0] if same else a
    rows = call(graph, user.target, (x, *args[1:]), user, user.kwargs)
    return call(graph, aten.flatten.using_ints, (rows, 0, 1), user)


def _alike(other, merge: Node, ctx: Context) -> bool:
    """``other`` merges the same batch and fixed heads as ``merge`` does."""
    return isinstance(other, Node) and merges_heads(other, ctx) and fixed_heads(other, ctx) and \
        sizes_of(ctx, other.args[0])[:2] == sizes_of(ctx, merge.args[0])[:2]


def fixed_heads(merge: Node, ctx: Context) -> bool:
    """The merged dim after the batch has a fixed size (heads; not tokens merged with the batch into rows)."""
    return ctx.static(ctx.shape(merge.args[0])[1])


def _row_dims(node: Node, rank: int):
    """Which positional args of ``node`` are dims, if it treats every row of its first operand alike (none across
    the merged rows); else None."""
    row = op(node.target)
    if node.target == aten.unsqueeze.default:
        return (1,) if node.args[1] % (rank + 1) != 0 else None
    if node.target == aten.transpose.int:  # of later dims (DeBERTa's ``k.transpose(-1, -2)`` of merged heads)
        return (1, 2) if node.args[1] % rank != 0 and node.args[2] % rank != 0 else None
    if row.family == "elementwise" or "by_number" in row.tags or "per_row" in row.tags:
        return ()
    if "per_row_over_dim" in row.tags:
        return (1,) if node.args[1] % rank != 0 else None
    return None


def _view(graph: torch.fx.Graph, merge: Node, user: Node, ctx: Context) -> Node | None:
    """A view of the merge back to [B, H, ...] (any later dims of the same count): a view of the unmerged value;
    a view keeping the merged dim: the later dims viewed on the unmerged value, merged after."""
    x = merge.args[0]
    unmerged, out = sizes_of(ctx, x), sizes_of(ctx, user)
    if out == unmerged:
        return x
    if out[:2] == unmerged[:2] and math.prod(out[2:]) == math.prod(unmerged[2:]):
        return call(graph, aten.reshape.default, (x, list(user.args[1])), user)
    if len(out) < 2 or out[0] != unmerged[0] * unmerged[1] or not fixed_heads(merge, ctx):
        return None
    batch, heads = ctx.shape(x)[:2]
    if not ctx.static(batch):
        batch = call(graph, aten.sym_size.int, (x, 0), x)
    rows = call(graph, aten.reshape.default, (x, [batch, heads, *user.args[1][1:]]), user)
    return call(graph, aten.reshape.default, (rows, list(user.args[1])), user)


def _einsum(graph: torch.fx.Graph, merge: Node, user: Node, ctx: Context) -> Node | None:
    """An einsum whose merged operand's first letter the output leads with, and every other operand that has it
    leads with it too and is a merge alike (Perceiver's ``einsum('b i d, b j d -> b i j', q, k)`` of heads merged
    by einops): that letter as two, batch and heads."""
    equation, operands = user.args[0], list(user.args[1])
    if "." in equation or "->" not in equation or operands.count(merge) != 1 or not fixed_heads(merge, ctx):
        return None
    ins, out = equation.replace(" ", "").split("->")
    ins = ins.split(",")
    letter = ins[operands.index(merge)][0]
    having = [i for i, s in enumerate(ins) if letter in s]
    if not out.startswith(letter) or any(ins[i][0] != letter or ins[i].count(letter) != 1
                                         or not _alike(operands[i], merge, ctx) for i in having):
        return None
    fresh = "".join(c for c in string.ascii_letters if c not in equation)[:2]
    for i in having:
        ins[i], operands[i] = fresh + ins[i][1:], operands[i].args[0]
    rows = call(graph, aten.einsum.default, (",".join(ins) + "->" + fresh + out[1:], operands), user)
    return call(graph, aten.flatten.using_ints, (rows, 0, 1), user)
