"""Rows flattened for an op over the last dim, kept apart.

The gated norms of linear-attention layers (Qwen3-Next, Qwen3.5, OLMo-hybrid) flatten the attention output and its
gate from [b, s, heads, d] to [b*s*heads, d], normalize each row and view the result back.  Heads merged with the
tokens are no dim a rule can split, so the norm, its gate and the attention before it would be gathered.  Ops that
treat each row alike give the same values on the unflattened tensors, so the flattening views are dropped where every
op they lead to (up to a view of another shape) is such an op.
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
    kept_apart = [_keep_apart(gm.graph, starts, region) for starts in groups.values()
                  for region in [_region(starts)] if region is not None
                  and all(_rowwise(n, region, starts) for n in region)]
    if kept_apart:
        gm.graph.lint()
        gm.recompile()


def _keep_apart(graph: torch.fx.Graph, starts: list, region: set) -> set:
    """The flattening views dropped, the ops between them and the views after them on the unflattened values."""
    for start in starts:
        start.replace_all_uses_with(_rows_of(graph, start))
        graph.erase_node(start)
    for node in [n for n in graph.nodes if n in region]:  # graph order: operands' values first
        node.args = tuple(_last_dim(node, i, a) for i, a in enumerate(node.args))
        values = [a.meta["val"] if isinstance(a, Node) else a for a in node.args]
        node.meta["val"] = node.target(*values, **node.kwargs)
    for view in [u for n in region for u in n.users if u not in region]:
        if list(view.meta["val"].shape) == list(view.args[0].meta["val"].shape):
            view.replace_all_uses_with(view.args[0])  # viewed back: the unflattened value itself
            graph.erase_node(view)
    return region


def _flattened_rows(node: Node, ctx: Context):
    """The leading sizes (as text) of x when ``node`` views x [..., d] (rank 3 or more) as [rows, d], or x
    [..., k*d] (rank 2 or more: a gate straight from its projection) as [rows, d]."""
    if "sized_view" not in op(node.target).tags or not isinstance(node.args[0], Node):
        return None
    inner, outer = list(ctx.shape(node.args[0])), ctx.shape(node)
    if len(outer) != 2 or not ctx.static(outer[1]) or not ctx.static(inner[-1]) or inner[-1] % outer[1]:
        return None
    if inner[-1] != outer[1]:
        inner[-1:] = [inner[-1] // outer[1], outer[1]]
    if len(inner) < 3 or ctx.probe(outer[0]) != math.prod(ctx.probe(s) for s in inner[:-1]):
        return None
    return tuple(str(s) for s in inner[:-1])


def _rows_of(graph: torch.fx.Graph, start: Node) -> Node:
    """What a flattening view becomes: its input, or its input with the last dim cut into [k, d]."""
    x, d = start.args[0], start.meta["val"].shape[-1]
    if x.meta["val"].shape[-1] == d:
        return x
    with graph.inserting_before(start):
        rows = graph.call_function(aten.unflatten.int, (x, -1, [x.meta["val"].shape[-1] // d, d]))
    rows.meta = {**start.meta, "val": x.meta["val"].unflatten(-1, (x.meta["val"].shape[-1] // d, d))}
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
    (a norm's weight, a number), or a reduction or softmax over the last dim."""
    if node.op != "call_function" or drops(node):
        return False
    flat = [a for a in node.all_input_nodes if a in region or a in starts]
    others = [a for a in node.all_input_nodes if a not in flat]
    if not flat or any(len(a.meta["val"].shape) > 1 for a in others if isinstance(a.meta.get("val"), torch.Tensor)):
        return False
    if "reduces_dims" in op(node.target).tags:
        dims = node.args[1] if len(node.args) > 1 else None
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        return bool(keep) and isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] in (-1, 1)
    if "per_row_over_dim" in op(node.target).tags:
        return node.args[1] in (-1, 1)
    schema = getattr(node.target, "_schema", None)
    return op(node.target).family == "elementwise" and schema is not None and not schema.is_mutable


def _last_dim(node: Node, index: int, arg):
    """A dim argument of a reduction or softmax over a flattened [rows, d] value, counted from the end."""
    if index == 1 and "reduces_dims" in op(node.target).tags:
        return [-1]
    if index == 1 and "per_row_over_dim" in op(node.target).tags:
        return -1
    return arg
