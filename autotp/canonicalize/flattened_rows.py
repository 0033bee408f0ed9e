"""Rows flattened for ops over their later dims, kept apart.

    before: f = view(x, [b*s*H, d]); n = mul(rsqrt(mean(mul(f, f), [-1], True)), f); y = view(n, [b, s, H*d])
    after:  n = mul(rsqrt(mean(mul(x, x), [-1], True)), x); y = view(n, [b, s, H*d])          (x: [b, s, H, d])

The gated norms of linear-attention layers (Qwen3-Next, Qwen3.5, OLMo-hybrid) flatten the attention output and its
gate from [b, s, heads, d] to [b*s*heads, d], normalize each row and view the result back; ConvBERT's span
convolution views its kernels [b, s, heads*k] as [b*s*heads, k, 1] and its windows [b, s, heads*d, k] as
[b*s*heads, d, k], softmaxes the kernels over k and multiplies the two row by row.  Heads merged with the tokens are
no dim a rule can split, so these ops and the attention before them would be gathered.  Ops that treat each row
alike give the same values on the unflattened tensors, so the flattening views are dropped where every op they lead
to (up to a view of another shape) is such an op: elementwise ops, reductions and softmaxes over later dims, and
products of two such rows.  Tests: tests/test_span_convolution.py (ConvBERT), tests/test_sublayers.py (the
linear-attention mixers' gated norm).
"""

from __future__ import annotations

import math

import torch
from torch.fx import Node

from autotp.ops.strategies import Context
from autotp.ops.table import drops, op

aten = torch.ops.aten


def unflatten_rows(gm: torch.fx.GraphModule) -> None:
    ctx = Context(world=1)
    groups: dict = {}
    for node in gm.graph.nodes:
        leading = _flattened_rows(node, ctx)
        if leading is not None:
            groups.setdefault(leading, []).append(node)
    kept_apart = [
        _keep_apart(gm.graph, starts, region, ctx)
        for starts in groups.values()
        for region in [_region(starts)]
        if region is not None and all(_rowwise(n, region, starts) for n in region)
    ]
    if kept_apart:
        gm.graph.lint()
        gm.recompile()


def _keep_apart(graph: torch.fx.Graph, starts: list, region: set, ctx: Context) -> set:
    """The flattening views dropped, the ops between them and the views after them on the unflattened values."""
    for start in starts:
        start.replace_all_uses_with(_rows_of(graph, start, ctx))
        graph.erase_node(start)
    for node in [n for n in graph.nodes if n in region]:  # graph order: operands' values first
        node.args = tuple(_from_end(node, i, a) for i, a in enumerate(node.args))
        node.target = aten.matmul.default if node.target == aten.bmm.default else node.target
        values = [a.meta["val"] if isinstance(a, Node) else a for a in node.args]
        node.meta["val"] = node.target(*values, **node.kwargs)
    for view in [u for n in region for u in n.users if u not in region]:
        if list(view.meta["val"].shape) == list(view.args[0].meta["val"].shape):
            view.replace_all_uses_with(view.args[0])  # viewed back: the unflattened value itself
            graph.erase_node(view)
    return region


def _flattened_rows(node: Node, ctx: Context):
    """The leading sizes (as text) of the rows when ``node`` views x [*lead, *mid] as [rows, *tail]: rows the lead
    (two dims or more) and k pieces of mid (k >= 1), tail static.  None for any other view."""
    cut = _cut(node, ctx)
    return None if cut is None else tuple(str(s) for s in cut[0]) + ((str(cut[1]),) if cut[1] > 1 else ())


def _cut(node: Node, ctx: Context):
    """(lead, k, mid) of a flattening view (see _flattened_rows), the longest lead that gives it, or None."""
    if "sized_view" not in op(node.target).tags or not isinstance(node.args[0], Node):
        return None
    inner, outer = list(ctx.shape(node.args[0])), ctx.shape(node)
    if len(outer) < 2 or not all(ctx.static(s) for s in outer[1:]):
        return None  # (a view to a number has no rows)
    rows, *tail = outer
    for at in range(len(inner) - 1, 0, -1):
        lead, mid = inner[:at], inner[at:]
        held = math.prod(ctx.probe(s) for s in lead)
        if not all(ctx.static(s) for s in mid) or not held or not ctx.probe(rows) or ctx.probe(rows) % held:
            continue  # (no rows at all: a run of size 0, Swin's padding where an image needs none)
        k = ctx.probe(rows) // held
        if math.prod(mid) == k * math.prod(tail) and len(lead) + (k > 1) >= 2 and _one_unflatten(mid, k, tail):
            return lead, k, mid
    return None


def _one_unflatten(mid: list, k: int, tail: list) -> bool:
    """mid cut as [k, *tail] by one unflatten: of its first dim (the rest as in tail), or of its only one."""
    return (len(mid) == len(tail) and mid[0] == k * tail[0] and mid[1:] == tail[1:]) or len(mid) == 1


def _rows_of(graph: torch.fx.Graph, start: Node, ctx: Context) -> Node:
    """What a flattening view becomes: its input, or its input with mid cut into [k, *tail]."""
    x = start.args[0]
    lead, k, mid = _cut(start, ctx)
    tail = list(start.meta["val"].shape[1:])
    if k == 1 and mid == tail:
        return x
    at, sizes = (len(lead), [k, tail[0]]) if len(mid) == len(tail) and mid[1:] == tail[1:] else (-1, [k, *tail])
    sizes = sizes[1:] if k == 1 else sizes  # mid one dim, cut into tail alone
    with graph.inserting_before(start):
        rows = graph.call_function(aten.unflatten.int, (x, at, sizes))
    rows.meta = {**start.meta, "val": x.meta["val"].unflatten(at, sizes)}
    return rows


def _region(starts: list):
    """The ops downstream of the flattening views, up to views (which read their input whole, so any shape does);
    None where a value leaves the graph."""
    region, todo = set(), list(starts)
    while todo:
        node = todo.pop()
        for user in node.users:
            if user.op == "output":
                return None
            if user not in region and "sized_view" not in op(user.target).tags:
                region.add(user)
                todo.append(user)
    return region


def _rowwise(node: Node, region: set, starts: list) -> bool:
    """``node`` treats each row alike: an elementwise op of flattened values and of values broadcast along a row
    (a norm's weight, a number), a reduction (keeping its dims) or softmax over later dims, or a product of two
    flattened [rows, m, k] and [rows, k, n] values."""
    if node.op != "call_function" or drops(node):
        return False
    flat = [a for a in node.all_input_nodes if a in region or a in starts]
    others = [a for a in node.all_input_nodes if a not in flat]
    if not flat or any(len(a.meta["val"].shape) > 1 for a in others if isinstance(a.meta.get("val"), torch.Tensor)):
        return False
    ranks = [len(a.meta["val"].shape) for a in flat if isinstance(a.meta.get("val"), torch.Tensor)]
    if len(ranks) != len(flat):
        return False  # a tuple of pieces (a split's): no row of its own
    rank = ranks[0]
    if "reduces_dims" in op(node.target).tags:
        dims = node.args[1] if len(node.args) > 1 else None
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        return bool(keep) and isinstance(dims, (list, tuple)) and bool(dims) and all(d % rank for d in dims)
    if "per_row_over_dim" in op(node.target).tags:
        return node.args[1] % rank != 0
    if op(node.target).family == "matmul":
        return len(flat) == 2 == len(node.args) and not others and ranks == [3, 3]
    schema = getattr(node.target, "_schema", None)
    return op(node.target).family == "elementwise" and schema is not None and not schema.is_mutable


def _from_end(node: Node, index: int, arg):
    """A dim argument of a reduction or softmax over flattened [rows, *tail] values, counted from the end (the
    tail dims stay last in the unflattened value)."""
    rank = len(node.meta["val"].shape)  # a softmax's, or a reduction's that keeps its dims: the input's rank
    if index == 1 and "reduces_dims" in op(node.target).tags:
        return [d - rank if d > 0 else d for d in arg]
    if index == 1 and "per_row_over_dim" in op(node.target).tags:
        return arg - rank if arg > 0 else arg
    return arg
