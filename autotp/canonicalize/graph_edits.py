"""What the canonical-form rewrites share: a new node with its value, what nothing reads erased, a slice that
keeps everything, and where a node or an attribute comes from."""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch.fx import Node

from autotp.ops.semantics import may_alias
from autotp.ops.table import op

aten = torch.ops.aten


def call(graph: torch.fx.Graph, target, args: tuple, like: Node, kwargs: dict | None = None) -> Node:
    """A new node computing ``target``, its value from its operands' (``like``'s other metadata)."""
    made = graph.call_function(target, args, kwargs or {})
    values = [
        [v.meta["val"] if isinstance(v, Node) else v for v in a]
        if isinstance(a, (list, tuple))
        else a.meta["val"]
        if isinstance(a, Node)
        else a
        for a in args
    ]
    made.meta = {**like.meta, "val": target(*values, **(kwargs or {}))}
    return made


def getattr_path(gm: torch.nn.Module, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def erase_unused(graph: torch.fx.Graph, nodes, also: Collection = ()) -> None:
    """Erase the given nodes that nothing reads any more, and then what only they read, back to the first op that
    is no pure view or product (nor one of ``also``: ops a rewrite knows to be free of effects)."""
    todo, erased = list(nodes), set()
    while todo:
        node = todo.pop()
        pure = node.op == "call_function" and (
            may_alias(node.target)
            or "pure" in op(node.target).tags
            or node.target == aten.sym_size.int
            or node.target in also
        )
        if pure and not node.users and node not in erased:
            todo += node.all_input_nodes
            graph.erase_node(node)
            erased.add(node)


def whole_slice(node) -> bool:
    """A ``slice`` from the start to the end (``x[:, :, a:b]`` slices dims 0 and 1 whole first)."""
    if node.target != aten.slice.Tensor or len(node.args) > 4:
        return False
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else None
    return start in (0, None) and (end is None or (isinstance(end, int) and end >= 2**62))


def module_path(node: Node) -> str:
    """The innermost module that produced this node: for reports, for the modules a user fixed whole, and for where
    a rewrite stores a constant it makes (never for a decision of autotp's own)."""
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""
