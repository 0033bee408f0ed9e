"""Autocast and grad-mode regions inlined.

    before: r = wrap_with_autocast('cpu', None, False, None, body, x); y = r[0]
    after:  e = _enter_autocast('cpu', None, False, None); ...body's ops on x...; _exit_autocast(e); y = (its output)

torch.export keeps ``with torch.autocast(...)`` and ``with torch.no_grad()`` blocks inside a model's forward as
higher-order ops around a subgraph (``wrap_with_autocast``, ``wrap_with_set_grad_enabled``), which no rule can see
into, so a rotary embedding computed with autocast off (as einops-style libraries write it) would stop the head
split of every attention.  Their ops are put back in the graph between the calls that enter and leave the mode (as
a traced ``with`` block runs), so the region keeps its meaning and the rules see its ops.
Test: tests/test_regions.py.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from autotp.canonicalize.graph_edits import getattr_path

_AUTOCAST = getattr(torch.ops.higher_order, "wrap_with_autocast", None)
_GRAD = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)


def inline_regions(gm: torch.fx.GraphModule) -> None:
    bodies = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if _AUTOCAST is not None and node.target is _AUTOCAST:
            bodies.append(node.args[4])
            _inline(gm, node, node.args[4], node.args[5:], _autocast_calls(node.args[:4]))
        elif _GRAD is not None and node.target is _GRAD:
            bodies.append(node.args[1])
            _inline(gm, node, node.args[1], node.args[2:], _grad_calls(node.args[0]))
    for body in dict.fromkeys(bodies):
        if not body.users:
            gm.graph.erase_node(body)
            gm.delete_submodule(body.target)
    if bodies:
        gm.recompile()


def _autocast_calls(mode: tuple):
    def enter(graph: torch.fx.Graph) -> Node:
        return graph.call_function(torch.amp._enter_autocast, tuple(mode))

    def leave(graph: torch.fx.Graph, entered: Node) -> None:
        graph.call_function(torch.amp._exit_autocast, (entered,))

    return enter, leave


def _grad_calls(enabled: bool):
    def enter(graph: torch.fx.Graph) -> Node:
        before = graph.call_function(torch.is_grad_enabled, ())
        graph.call_function(torch._C._set_grad_enabled, (enabled,))
        return before

    def leave(graph: torch.fx.Graph, before: Node) -> None:
        graph.call_function(torch._C._set_grad_enabled, (before,))

    return enter, leave


def _inline(gm: torch.fx.GraphModule, node: Node, body: Node, operands: tuple, calls) -> None:
    """The body's ops in place of ``node``, between ``enter`` and ``leave``; the getitems of ``node`` read them."""
    enter, leave = calls
    sub = getattr(gm, body.target)
    graph = gm.graph
    with graph.inserting_before(node):
        entered = enter(graph)
        env = dict(zip((n for n in sub.graph.nodes if n.op == "placeholder"), operands, strict=True))
        results = None
        for inner in sub.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                results = torch.fx.map_arg(inner.args[0], env.__getitem__)
                continue
            if inner.op == "get_attr":  # a constant of the body: a module attribute of the graph
                name = _adopt(gm, sub, inner.target)
                env[inner] = graph.get_attr(name)
            else:
                env[inner] = graph.node_copy(inner, env.__getitem__)
            env[inner].meta = dict(inner.meta)
        leave(graph, entered)
    outputs = results if isinstance(results, (tuple, list)) else (results,)
    for user in list(node.users):
        if user.target is operator.getitem and isinstance(user.args[1], int):
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
    if node.users:  # read whole: a tuple of the outputs
        with graph.inserting_before(node):
            whole = graph.call_function(tuple, (list(outputs),))
        node.replace_all_uses_with(whole)
    graph.erase_node(node)


def _adopt(gm: torch.fx.GraphModule, sub: torch.nn.Module, target: str) -> str:
    value = getattr_path(sub, target)
    name = "_inlined_" + target.replace(".", "_")
    while hasattr(gm, name) and getattr(gm, name) is not value:
        name += "_"
    if isinstance(value, torch.nn.Module):
        gm.add_submodule(name, value)
    else:
        setattr(gm, name, value)
    return name
