"""Expert segments, found from the graph: what expert parallelism by all-to-all dispatches.

A segment is everything between the first and the last expert product of one routing (a grouped matmul's
offsets, or the ids of a 3-D weight's lookup ``w[ids]`` before a ``bmm``): the products, the row-wise ops
between them (activations, gate/up cuts, casts) and the lookups of expert tables by the routing ids (biases).
Its inputs from outside are the routed rows (one per routed slot, dim 0), the key, and the expert tables under
layout ops; its one output is the last product.  The router, the sort and the combine with the routing
weights stay outside and run where the tokens are.  An owner of experts can run the segment's own ops on the
rows routed to its experts alone, with its local key (runtime/expert_dispatch.py): no op needs a rule of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from autotp.ops.expert_rules import is_grouped_mm, offsets, routing
from autotp.ops.strategies import Context, shape, value
from autotp.ops.table import op
from autotp.runtime.expert_dispatch import ExpertDispatch, Group

aten = torch.ops.aten


@dataclass(frozen=True, eq=False)
class Segment:
    key: Node  # grouped: the offsets; else the ids of the lookups
    grouped: bool
    experts: int
    nodes: tuple  # in graph order, the exit last
    tables: tuple  # get_attr nodes of the expert tables (dim 0: the experts)
    views: tuple  # layout ops between a table and the segment (transposes, casts)
    slots: object  # the routed rows' count (dim 0 of the rows), as the capture sizes it

    @property
    def exit(self) -> Node:
        return self.nodes[-1]

    @property
    def first(self) -> Node:
        return self.nodes[0]


def _table(node: Node) -> tuple[Node | None, list]:
    """The expert table (get_attr) under layout ops, and those ops; (None, []) if ``node`` is not one."""
    views = []
    while node.op == "call_function" and op(node.target).layout and node.target != aten.index.Tensor:
        views.append(node)
        node = node.args[0]
    return (node, views) if node.op == "get_attr" else (None, [])


def _lookup(node: Node, key: Node) -> bool:
    """``table[key]``: one expert's rows per routed slot."""
    return (
        node.op == "call_function"
        and node.target == aten.index.Tensor
        and len(node.args[1]) == 1
        and node.args[1][0] is key
        and _table(node.args[0])[0] is not None
    )


def _products(gm: torch.fx.GraphModule, ctx: Context) -> dict:
    """routing key -> (expert products, their lookups ``w[ids]``) in graph order."""
    found: dict = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if is_grouped_mm(n) and offsets(n) is not None:
            found.setdefault(offsets(n), ([], []))[0].append(n)
        elif n.target == aten.bmm.default:
            for a in n.args[:2]:
                r = routing(a, ctx)
                if r is not None and _lookup(a, r[0]):
                    found.setdefault(r[0], ([], []))[0].append(n)
                    found[r[0]][1].append(a)
    return found


def _related(start: list, step) -> set:
    seen, todo = set(), list(start)
    while todo:
        for nxt in step(todo.pop()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def find(gm: torch.fx.GraphModule, ctx: Context) -> list[Segment]:
    """The segments an owner of experts can run on its routed rows alone: one exit, no size argument inside,
    and every input from outside a routed row, the key or an expert table."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    found = []
    for key, (products, lookups) in _products(gm, ctx).items():
        grouped = is_grouped_mm(products[0])
        firsts = products if grouped else lookups
        last = max(products, key=order.get)
        inside = set(firsts) | {last}
        inside |= _related(firsts, lambda n: n.users) & _related([last], lambda n: n.all_input_nodes)
        inside |= {a for n in inside for a in n.all_input_nodes if _lookup(a, key)}  # biases by the ids
        segment = _segment(key, grouped, sorted(inside, key=order.get), ctx)
        if segment is not None:
            found.append(segment)
    return found


def _segment(key: Node, grouped: bool, nodes: list, ctx: Context) -> Segment | None:
    first = nodes[0]  # grouped: the first product, whose rows are the slots; else a lookup, one row a slot
    slots = ctx.shape(first.args[0] if grouped else first)[0]
    inside = set(nodes)
    if any(u not in inside for n in nodes[:-1] for u in n.users):
        return None  # a value escapes before the exit
    tables, views = [], []
    for n in nodes:
        for a in n.all_input_nodes:
            if a in inside or a is key:
                continue
            table, chain = _table(a)
            if (
                table is not None
                and len(ctx.shape(table))
                and ctx.probe(ctx.shape(table)[0]) == ctx.probe(_experts(nodes, ctx))
            ):
                tables.append(table)
                views += chain
            elif not (
                isinstance(value(a), torch.Tensor)
                and len(ctx.shape(a))
                and ctx.probe(ctx.shape(a)[0]) == ctx.probe(slots)
            ):
                return None  # neither a routed row, nor the key, nor an expert table
        if any(isinstance(a, Node) and not isinstance(value(a), (torch.Tensor, list, tuple)) for a in n.args):
            return None  # a size argument: it may count the rows, which an owner does not hold
    experts = _experts(nodes, ctx)
    return Segment(
        key, grouped, experts, tuple(nodes), tuple(dict.fromkeys(tables)), tuple(dict.fromkeys(views)), slots
    )


def _experts(nodes: list, ctx: Context) -> int:
    for n in nodes:
        r = routing(n, ctx)
        if r is not None:
            return r[1]
    raise AssertionError("a segment without an expert product")


def members(segments: list[Segment]) -> dict:
    """node -> its segment, for the segments' nodes and their tables' layout ops and tables."""
    return {n: s for s in segments for n in (*s.nodes, *s.views, *s.tables)}


def dispatch(
    gm: torch.fx.GraphModule, segment: Segment, owners: list, group: Group, copies: Group | None, where: str
) -> None:
    """Replace ``segment`` in ``gm`` (this rank's program, tables already this rank's experts) by one call of
    runtime.expert_dispatch.ExpertDispatch on a sub-GraphModule of the segment's own nodes."""
    graph = gm.graph  # the rewrite may have put conversions between the segment's nodes: they belong to it
    inside = (_related(segment.nodes, lambda n: n.users) & _related([segment.exit], lambda n: n.all_input_nodes)) | set(
        segment.nodes
    )
    order = {n: i for i, n in enumerate(graph.nodes)}
    nodes = sorted(inside, key=order.get)
    rows, rest = [], []
    for n in nodes:
        for a in n.all_input_nodes:
            if a in inside or a is segment.key or a in rows or a in rest:
                continue
            row = isinstance(value(a), torch.Tensor) and len(shape(a)) and _table(a)[0] is None
            (rows if row else rest).append(a)
    sub = torch.fx.Graph()
    env = {a: sub.placeholder(f"row_{k}") for k, a in enumerate(rows)}
    env[segment.key] = sub.placeholder("local_key")
    env.update({a: sub.placeholder(f"input_{k}") for k, a in enumerate(rest)})
    for n in nodes:
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(env[segment.exit])
    name = f"autotp_experts_{segment.exit.name}"
    module = ExpertDispatch(
        torch.fx.GraphModule(gm, sub),
        experts=segment.experts,
        grouped=segment.grouped,
        rows=len(rows),
        outputs=1,
        owners=owners,
        group=group,
        copies=copies,
        where=where,
    )
    gm.add_submodule(name, module)
    with graph.inserting_before(segment.exit):
        call = graph.call_module(name, (segment.key, *rows, *rest))
    call.meta = dict(segment.exit.meta)
    segment.exit.replace_all_uses_with(call)
    for n in reversed(nodes):
        graph.erase_node(n)
