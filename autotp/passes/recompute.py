"""Selective recomputation of the attention core (Korthikanti et al. 2022, §5): the ops between the
attention projections -- QK^T, scale, mask, softmax, dropout, ·V, or one fused SDPA -- keep the
largest tensors of a block (5·a·s²·b bytes per layer for materialized scores) yet cost few FLOPs,
so their backward may compute them again instead of keeping them.

Regions are found from the graph alone: a matmul of two activations whose downstream ops, followed
until the next matmul, hold a softmax and all meet in one matmul of two activations (the score and
value products), or an SDPA op.  Nothing leaves a region but its last node's output, so running it
again under ``torch.utils.checkpoint`` reproduces every value (dropout masks included: the default
generators are restored, and every mask is drawn from them; autotp/runtime/dropout.py).  What a recomputed
region drops: the tensors its ops keep whose storage it computes itself and no op outside keeps.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from autotp.ops.table import is_product, op
from autotp.passes.kept_tensors import storage
from autotp.runtime.activations import Recomputed

_LARGEST = 64  # an attention core is a handful of ops; a longer walk is something else


def _activation_product(node: Node) -> bool:
    """A product of two computed tensors (not parameters, buffers or inputs): q·k, p·v."""
    return op(node.target).family == "matmul" and _of_activations(node)


def _of_activations(node: Node) -> bool:
    """Both operands are computed tensors (not parameters, buffers or inputs): q·k, p·v."""
    return all(isinstance(a, Node) and storage(a).op == "call_function" for a in node.args[:2])


def _core_from(first: Node) -> list[Node] | None:
    """The ops from the score product ``first`` to the value product, in graph order, or None."""
    region, todo, ends = {first}, [first], set()
    while todo:
        for user in todo.pop().users:
            if user in region:
                continue
            if is_product(user):
                ends.add(user)
            elif user.op != "call_function" or len(region) >= _LARGEST:
                return None  # reaches the output, or runs on past any attention core
            else:
                region.add(user)
                todo.append(user)
    if len(ends) != 1:
        return None
    last = ends.pop()
    if not _activation_product(last) or not any(op(n.target).family == "softmax" for n in region):
        return None
    order = {n: i for i, n in enumerate(first.graph.nodes)}
    return sorted(region | {last}, key=order.__getitem__)


def attention_cores(gm: GraphModule, grad: set) -> list[list[Node]]:
    """Every attention core whose output the backward needs, each as its ops in graph order (last: its output)."""
    cores = []
    for node in gm.graph.nodes:
        if node not in grad or node.op != "call_function":
            continue
        if op(node.target).family == "attention":
            cores.append([node])
        elif _activation_product(node):
            core = _core_from(node)
            if core is not None and core[-1] in grad:
                cores.append(core)
    return cores


def dropped(keepers: dict, core: list[Node]) -> set:
    """Keys (tensor, ...) of ``keepers`` (key -> nodes that keep it) a recomputed ``core`` no longer keeps."""
    inside = set(core)
    return {key for key, nodes in keepers.items() if key[0] in inside and nodes <= inside}


def _with_conversions(core: list[Node]) -> list[Node] | None:
    """``core`` in the rewritten program: with the conversions the rewrite put between its ops (they run
    again in the backward, on every rank alike); None if a value inside is read from outside after all."""
    order = {n: i for i, n in enumerate(core[0].graph.nodes)}
    inside, last = set(core), core[-1]
    between = [n for n in core[0].graph.nodes if order[core[0]] < order[n] < order[last] and n not in inside]
    for node in between:  # graph order: a conversion of a conversion follows it
        if any(a in inside for a in node.all_input_nodes):
            inside.add(node)
    leads = {last}
    for node in sorted(inside, key=order.__getitem__, reverse=True):
        if node in leads:
            leads.update(a for a in node.all_input_nodes if a in inside)
    if any(u not in leads for n in leads - {last} for u in n.users):
        return None
    return sorted(leads, key=order.__getitem__)


def checkpoint_cores(gm: GraphModule, cores: list[list[Node]]) -> None:
    """Replace each core of the (rewritten) program by a call of a ``Recomputed`` copy of its ops;
    their inputs (after any conversion the rewrite put before them) are the call's arguments."""
    graph = gm.graph
    for k, found in enumerate(cores):
        core = _with_conversions(found)
        if core is None:
            continue  # kept as it is: exact, only its memory is not saved
        inside, last = set(core), core[-1]
        inputs = list(dict.fromkeys(a for n in core for a in n.all_input_nodes if a not in inside))
        sub = torch.fx.Graph()
        env = {a: sub.placeholder(f"in_{a.name}") for a in inputs}
        for node in core:
            env[node] = sub.node_copy(node, env.__getitem__)
        sub.output(env[last])
        name = f"autotp_recompute_{k}"
        gm.add_submodule(name, Recomputed(GraphModule(gm, sub)))  # its ops' modules (dropouts) are gm's
        with graph.inserting_before(last):
            call = graph.call_module(name, tuple(inputs))
        call.meta = dict(last.meta)
        last.replace_all_uses_with(call)
        for node in reversed(core):
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
