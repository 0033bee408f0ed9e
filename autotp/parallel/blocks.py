"""The TP program cut into one submodule per repeated block, so that FSDP2 can take each block as a unit.

autotp's rewrite produces one fx graph for the whole model (or stage), whose forward never calls a submodule:
``fully_shard`` on it makes one unit that gathers every parameter at once.  Here each block's nodes move into a
GraphModule installed where the block was (``model.layers.3``), called from the root graph; it holds the same
Parameter objects, so every name stays the model's.  A node belongs to a block by its module scope (passes/fold);
nodes autotp inserted (collectives, conversions) carry none and go with the block that consumes them, else with
the one that produces their input.  A block whose values are read by the root before the block's last node (its
ops interleaved with the root's) cannot be called as one unit: it stays in the root (``blocks`` says which are
units).  The rewrite sums the gradients of sequence parallelism's norm weights in one all-reduce for the whole
model (runtime/collectives.sum_group_grads); a unit must own its parameters' reads, so here that sum is made one
per block instead (one all-reduce per block, issued within that block's backward).
"""

from __future__ import annotations

import operator
import warnings

import torch
from torch.fx import Node

from autotp.passes.fold import Fold, scope_block
from autotp.passes.rewrite import summed_where
from autotp.runtime.collectives import sum_group_grads


def block_units(gm: torch.fx.GraphModule, path: str) -> list[str]:
    """In place: every block of the list at ``path`` that ``gm`` runs becomes a submodule called from the root
    graph.  Returns the blocks' paths, in the order they run."""
    indices = sorted(
        {i for n in gm.graph.nodes if n.op == "get_attr" and (i := Fold(path, 0).block_of_name(n.target)) is not None}
    )
    if not indices:
        return []
    fold = Fold(path, indices[-1] + 1)
    _sums_per_block(gm, fold)
    scope = _scopes(gm, fold)
    made = [f"{path}.{i}" for i in indices if _cut(gm, fold, i, [n for n in gm.graph.nodes if scope.get(n) == i])]
    gm.graph.lint()
    gm.recompile()
    left = [f"{path}.{i}" for i in indices if f"{path}.{i}" not in made]
    if left:
        warnings.warn(
            f"autotp: FSDP2 units: {len(left)} of {len(indices)} blocks stay in the root unit ({', '.join(left[:3])}"
            f"{', ...' if len(left) > 3 else ''}): the root reads their values before they end, or they read another "
            "block's weights, so their parameters are gathered with the root's for the whole step "
            "(docs/pipelines.md#fsdp2-per-block)",
            stacklevel=2,
        )
    return made


def _sums_per_block(gm: torch.fx.GraphModule, fold: Fold) -> None:
    """Each gradient sum over parameters of several blocks becomes one sum per block (and one for the root's)."""
    for node in [n for n in gm.graph.nodes if n.target is sum_group_grads]:
        members, layouts, *rest, _ = node.args
        if any(m.op != "get_attr" for m in members) or any(u.target is not operator.getitem for u in node.users):
            continue  # not as rewrite._sum_gradients makes it: left whole (the blocks it reads stay in the root)
        parts: dict = {}
        for k, member in enumerate(members):
            parts.setdefault(fold.block_of_name(member.target), []).append(k)
        if len(parts) < 2:
            continue
        items = {user.args[1]: user for user in node.users}
        for ks in parts.values():
            part_members = [members[k] for k in ks]
            with gm.graph.inserting_before(node):
                part = gm.graph.call_function(
                    sum_group_grads, (part_members, [layouts[k] for k in ks], *rest, summed_where(part_members))
                )
            for j, k in enumerate(ks):
                if k in items:
                    items[k].args = (part, j)
        gm.graph.erase_node(node)


def _scopes(gm: torch.fx.GraphModule, fold: Fold) -> dict:
    """node -> block index or None: by module scope; autotp's recomputed cores (call_module) by the core's scope;
    unscoped inserted nodes by their consumers' block when all agree, else by their producer's."""
    nodes = list(gm.graph.nodes)
    scope = {n: None if n.op in ("output", "placeholder") else scope_block(n, fold) for n in nodes}
    for n in nodes:
        if n.op == "call_module":
            scope[n] = next(
                (
                    i
                    for p, _ in (n.meta.get("nn_module_stack") or {}).values()
                    if (i := fold.block_of_name(p)) is not None
                ),
                None,
            )
    for n in reversed(nodes):  # users before producers
        if n.op != "call_function" or scope[n] is not None or n.meta.get("nn_module_stack"):
            continue
        users = {scope[u] for u in n.users} - {None}
        producers = [scope[a] for a in n.all_input_nodes if a.op != "get_attr" and scope[a] is not None]
        scope[n] = users.pop() if len(users) == 1 else producers[0] if producers else None
    return scope


def _cut(gm: torch.fx.GraphModule, fold: Fold, index: int, members: list[Node]) -> bool:
    """Move ``members`` (block ``index``'s nodes, in graph order) into a GraphModule called where the last of them
    ran; False (nothing changed) when the root reads a value of the block before that point."""
    if not members:
        return False
    graph, inside, last = gm.graph, set(members), members[-1]
    order = {n: k for k, n in enumerate(graph.nodes)}
    inputs = list(dict.fromkeys(a for n in members for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in members if any(u not in inside for u in n.users)]
    if any(order[u] < order[last] for o in outputs for u in o.users if u not in inside):
        return False
    if any(a.op == "get_attr" and fold.block_of_name(a.target) is not None for a in inputs):
        return False  # another block's weight: the unit would not own it
    prefix = f"{fold.path}.{index}."
    sub, env = torch.fx.Graph(), {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in members:
        if n.op == "get_attr":
            env[n] = sub.get_attr(n.target.removeprefix(prefix))
            env[n].meta = dict(n.meta)
        else:
            env[n] = sub.node_copy(n, env.__getitem__)
    sub.output(tuple(env[o] for o in outputs))
    owner = gm.get_submodule(f"{fold.path}.{index}")
    moved = [n.target for n in members if n.op == "call_module"]  # autotp_recompute_k: goes with its block
    for name in moved:
        owner.add_module(name, gm.get_submodule(name))
    block = torch.fx.GraphModule(owner, sub, class_name="Block")
    for name in moved:
        delattr(owner, name)
        delattr(gm, name)
    gm.get_submodule(fold.path).register_module(str(index), block)
    with graph.inserting_after(last):
        call = graph.call_module(f"{fold.path}.{index}", tuple(inputs))
    at = call
    for k, o in enumerate(outputs):
        with graph.inserting_after(at):
            item = graph.call_function(operator.getitem, (call, k))
        item.meta = dict(o.meta)
        o.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
        at = item
    for n in reversed(members):
        graph.erase_node(n)
    return True
