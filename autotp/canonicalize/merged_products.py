"""Batched products of heads merged with the batch, 4-D products.

    before: s = baddbmm(alibi, view(q, [B*H, S, d]), view(k, [B*H, d, S]), beta=b, alpha=a); y = view(s, [B, H, S, S])
    after:  y = add(mul(alibi', b), mul(matmul(q, k), a))          (alibi' the [B, H, ...] value alibi repeats)

BLOOM's ``alibi.baddbmm(q, k^T)`` and ``probs.bmm(v)``, MVP's ``q.bmm(k^T).softmax(-1)`` (its merge moved on by
merged_rows.py).  Tests: tests/test_merged_heads.py, tests/test_layouts.py (ALiBi heads merged with the batch).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from autotp.canonicalize.batch_merges import fixed_heads, flattens_heads, merges_heads, sizes_of
from autotp.canonicalize.graph_edits import call, erase_unused
from autotp.ops.strategies import Context
from autotp.ops.table import op

aten = torch.ops.aten


def _unmerged(node: Node, b: int, h: int, ctx: Context):
    """How the [b*h, ...] operand ``node`` is a [b, h, ...] value: (source, broadcast over b, transposes to apply),
    or None.  Sources: a view of a [b, h, ...] tensor, or ``x.repeat(b, 1, ...)`` of an [h, ...] one (BLOOM's
    alibi slopes); transposes of the other dims pass through."""
    moves = []
    while node.target == aten.transpose.int:
        n = len(ctx.shape(node))
        pair = (node.args[1] % n, node.args[2] % n)
        if 0 in pair:
            return None
        moves.append((pair[0] + 1, pair[1] + 1))
        node = node.args[0]
    src = node.args[0] if node.args and isinstance(node.args[0], Node) else None
    if src is None:
        return None
    inner = sizes_of(ctx, src)
    merges = "sized_view" in op(node.target).tags or flattens_heads(node)
    if merges and inner[:2] == [b, h] and inner[2:] == sizes_of(ctx, node)[1:]:
        return src, False, moves[::-1]
    if node.target == aten.repeat.default and len(node.args[1]) == len(inner) and inner[0] == h:
        first, *rest = node.args[1]
        times = ctx.probe(first.meta["val"] if isinstance(first, Node) else first)
        if times == b and all(r == 1 for r in rest):
            return src, True, moves[::-1]
    return None


def _broadcast(node, ctx: Context) -> bool:
    """A ``baddbmm`` input that one [1, ...] (or fewer dims) row broadcasts over all [B*H] rows."""
    shape = ctx.shape(node) if isinstance(node, Node) else ()
    return 0 < len(shape) < 3 or (len(shape) == 3 and shape[0] == 1)


def _built(graph: torch.fx.Graph, recipe) -> Node:
    src, broadcast, moves = recipe
    value = src
    steps = [(aten.unsqueeze.default, (0,))] * broadcast + [(aten.transpose.int, m) for m in moves]
    for target, extra in steps:
        value = call(graph, target, (value, *extra), src)
    return value


def _heads(node: Node, ctx: Context):
    """(B, H) of a [B*H, ...] product operand that views (through transposes) a [B, H, ...] tensor, H fixed."""
    while node.target == aten.transpose.int and 0 not in (node.args[1] % 3, node.args[2] % 3):
        node = node.args[0]
    if not merges_heads(node, ctx) or not fixed_heads(node, ctx):
        return None
    return tuple(sizes_of(ctx, node.args[0])[:2])


def _batched(node: Node, ctx: Context) -> bool:
    """bmm / baddbmm, or a matmul of two 3-D operands (the same product)."""
    return "batched_product" in op(node.target).tags or (
        node.target == aten.matmul.default
        and all(isinstance(a, Node) and len(ctx.shape(a)) == 3 for a in node.args[:2])
    )


def merged_products(gm: torch.fx.GraphModule, ctx: Context) -> None:
    """``bmm`` / ``baddbmm`` (or a 3-D ``matmul``) of [B*H, ...] operands (BLOOM's ``alibi.baddbmm(q, k^T)`` and
    ``probs.bmm(v)``)  =>  the 4-D matmul of the unmerged operands (``beta * input + alpha * (a @ b)``), and where
    the result is not only viewed back as [B, H, ...], a merge of it that merged_rows moves on (MVP's
    ``q.bmm(k^T).softmax(-1)``)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if not _batched(node, ctx):
            continue
        users = list(node.users)
        shapes = {tuple(sizes_of(ctx, u)) for u in users}
        back = bool(users) and all("sized_view" in op(u.target).tags for u in users) and len(shapes) == 1
        if back:
            ((b, h, *rest),) = shapes
            back = (
                rest == sizes_of(ctx, node)[1:]
                and b * h == sizes_of(ctx, node)[0]
                and ctx.static(ctx.shape(users[0])[1])
            )
        if not back:
            found = {_heads(a, ctx) for a in node.args[:3] if isinstance(a, Node)} - {None}
            if len(found) != 1:
                continue
            ((b, h),) = found
        operands = node.args[:3] if node.target == aten.baddbmm.default else (None, *node.args[:2])
        recipes = [_unmerged(a, b, h, ctx) if a is not None else None for a in operands]
        if operands[0] is not None and recipes[0] is None and _broadcast(operands[0], ctx):
            recipes[0] = (operands[0], False, [])  # a mask alike for every row: alike for every (batch, head)
        if None in recipes[1:] or (operands[0] is not None and recipes[0] is None):
            continue
        like = users[0] if back else node
        with graph.inserting_before(node):
            bias, left, right = (_built(graph, r) if r is not None else None for r in recipes)
            value = call(graph, aten.matmul.default, (left, right), like)
            alpha, beta = node.kwargs.get("alpha", 1), node.kwargs.get("beta", 1)
            if alpha != 1:
                value = call(graph, aten.mul.Tensor, (value, alpha), like)
            if bias is not None:
                bias = call(graph, aten.mul.Tensor, (bias, beta), like) if beta != 1 else bias
                value = call(graph, aten.add.Tensor, (bias, value), like)
            if not back:
                node.replace_all_uses_with(call(graph, aten.flatten.using_ints, (value, 0, 1), node))
        for user in users if back else ():
            user.replace_all_uses_with(value)
            graph.erase_node(user)
        graph.erase_node(node)
        erase_unused(graph, [a for a in operands if a is not None])
