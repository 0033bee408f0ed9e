"""Heads merged with the batch, moved on past the ops that treat every [B*H] row alike.

    before: m = reshape(q, [B*H, h, w, c]); r = einsum('bhwc,hkc->bhwk', m, t); y = view(unsqueeze(r, -1), ...)
    after:  r = einsum('xyhwc,hkc->xyhwk', q, t); y = view(flatten(unsqueeze(r, -1), 0, 1), ...)    (q: [B, H, ...])

A view of [B, H, ...] as [B*H, ...] hides the heads from the rules.  Each op between such a merge and the product
or view that ends it is rewritten on [B, H, ...] with the merge after it, until the merge meets a view back to
[B, H, ...] (then it is gone) or a product (merged_products.py rewrites that): ops over later dims
(softmax, dropout, a cast, an unsqueeze, a transpose), elementwise ops of merges alike, an einsum whose merged letter
only that operand and the output lead with, a view of the later dims.  SAM's and ViTDet's decomposed relative
positions are all of these: ``q.reshape(B*H, h, w, c)`` in two einsums, unsqueezed, added, viewed as [B, H, N, N].
A pick of q, k and v from [3, B*H, ...] is made from [3, B, H, ...] and merged after (merged_picks.py).
Tests: tests/test_sublayers.py (relative positions, merged keys transposed, einsums of two merges),
tests/test_merged_heads.py.
"""

from __future__ import annotations

import math
import string

import torch
from torch.fx import Node

from autotp.canonicalize.batch_merges import fixed_heads, merges_heads, sizes_of
from autotp.canonicalize.graph_edits import call
from autotp.ops.strategies import Context
from autotp.ops.table import op

aten = torch.ops.aten


def merged_rows(gm: torch.fx.GraphModule, ctx: Context) -> None:
    """Each merge's readers rewritten on the unmerged value where they can be (_on_unmerged), the merge after them."""
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
                made = _on_unmerged(graph, merge, user, ctx)
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


def _on_unmerged(graph: torch.fx.Graph, merge: Node, user: Node, ctx: Context) -> Node | None:
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
            if not (
                same
                or (
                    isinstance(a.meta.get("val"), torch.Tensor)
                    and (a.meta["val"].dim() < len(unmerged) - 1 or sizes_of(ctx, a)[0] == 1)
                )
            ):
                return None
            args[i] = a.args[0] if same else a
    rows = call(graph, user.target, (x, *args[1:]), user, user.kwargs)
    return call(graph, aten.flatten.using_ints, (rows, 0, 1), user)


def _alike(other, merge: Node, ctx: Context) -> bool:
    """``other`` merges the same batch and fixed heads as ``merge`` does."""
    return (
        isinstance(other, Node)
        and merges_heads(other, ctx)
        and fixed_heads(other, ctx)
        and sizes_of(ctx, other.args[0])[:2] == sizes_of(ctx, merge.args[0])[:2]
    )


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
    if not out.startswith(letter) or any(
        ins[i][0] != letter or ins[i].count(letter) != 1 or not _alike(operands[i], merge, ctx) for i in having
    ):
        return None
    fresh = "".join(c for c in string.ascii_letters if c not in equation)[:2]
    for i in having:
        ins[i], operands[i] = fresh + ins[i][1:], operands[i].args[0]
    rows = call(graph, aten.einsum.default, (",".join(ins) + "->" + fresh + out[1:], operands), user)
    return call(graph, aten.flatten.using_ints, (rows, 0, 1), user)
