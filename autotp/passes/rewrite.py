"""Rewrite the captured graph into this rank's program: local shards, explicit collectives,
and size arguments of view/reshape/expand/split adjusted to local shapes."""

from __future__ import annotations

import operator
from collections.abc import Collection

import torch
from torch.fx import Node
from torch.fx.node import map_arg

from autotp.canonicalize.graph_edits import module_path
from autotp.ops import expert_segments
from autotp.ops.local_forms import full_size, local_sizes
from autotp.ops.semantics import writes
from autotp.ops.strategies import Context, Strategy, input_slots, needs_grad, token_inputs
from autotp.ops.table import SIZE, TABLE, op
from autotp.passes.gradients import gradient_sums, partial_grad, partial_params
from autotp.placement import Partial, R, Replicate, Routed, Shard, take_local
from autotp.runtime import activations, collectives
from autotp.runtime.expert_dispatch import Dealt, Group, Groups


def _attribute(gm: torch.nn.Module, target: str):
    owner, _, attr = target.rpartition(".")
    return getattr(gm.get_submodule(owner), attr, None)


def _written(gm: torch.fx.GraphModule) -> set:
    """Tensors of the module that the program writes in place (a KV cache): their start is zeros."""
    return {
        node.target
        for node in gm.graph.nodes
        if node.op == "get_attr" and any(writes(user, node) for user in node.users)
    }


def shard_parameters(
    gm: torch.fx.GraphModule,
    placements: dict,
    rank: int,
    world: int,
    provided: frozenset = frozenset(),
    device: torch.device | None = None,
    dealt: dict | None = None,
) -> None:
    """Give the module its own copy of every parameter and buffer, sharded as planned.

    Copies of the captured model's tensors (never views, so that the user's model is untouched).  A tensor that
    the caller fills later (``provided``: a checkpoint holds it under one of its names) or that has no values (the
    meta device) is this rank's local shape on the meta device, for runtime/materialize.py to fill; the rest are on
    ``device`` (a CPU model's pieces moved to the GPU its group runs on).  Tied tensors stay tied.  ``dealt``:
    name -> runtime.expert_dispatch.Dealt for expert tables dealt over a dispatch group: this rank's experts first, then
    the plan's TP placement of them.
    """
    dealt = dealt or {}
    from autotp.runtime.hf_checkpoint import CheckpointError

    tensors = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]
    known = {name for name, _ in tensors}
    constants = {
        node.target
        for node in gm.graph.nodes  # lifted tensor constants (a KV cache)
        if node.op == "get_attr" and node.target not in known and isinstance(_attribute(gm, node.target), torch.Tensor)
    }
    tensors += [(name, _attribute(gm, name)) for name in sorted(constants)]
    written = _written(gm)
    aliases: dict = {}
    for name, tensor in tensors:
        aliases.setdefault(id(tensor), []).append(name)
    by_id = {id(tensor): placements[name] for name, tensor in tensors if name in placements}
    done: dict = {}
    for name, tensor in tensors:
        owner_name, _, attr = name.rpartition(".")
        owner = gm.get_submodule(owner_name)
        if id(tensor) not in done:
            placement = by_id.get(id(tensor), R)
            deal = dealt.get(name)
            placement = R if isinstance(placement, Routed) else placement  # dealt whole over its dispatch group
            shape = local_sizes(deal.shape(tensor.shape) if deal else list(tensor.shape), placement, rank, world)
            if tensor.is_meta and name in written:  # state the program fills itself (a KV cache)
                local = torch.zeros(shape, dtype=tensor.dtype, device=device)
            elif tensor.is_meta and name in constants:  # e.g. x[..., [-2], :]'s positions: made up = wrong
                raise CheckpointError(
                    f"{name} is a tensor the model's forward creates (such as index positions) "
                    "and it was created on the meta device, so its values are unknown: build "
                    "this model on a real device (its weights may still come from checkpoint=DIR)"
                )
            elif tensor.is_meta or any(n in provided for n in aliases[id(tensor)]):
                local = torch.empty(shape, dtype=tensor.dtype, device="meta")
            else:
                data = tensor.detach() if deal is None else deal.local(tensor.detach())
                local = take_local(data, placement, rank, world) if isinstance(placement, Shard) else data
                local = local.to(device, copy=True) if device is not None else local.clone()  # only this piece moves
            if isinstance(tensor, torch.nn.Parameter):
                local = torch.nn.Parameter(local, requires_grad=tensor.requires_grad)
            done[id(tensor)] = local
        if isinstance(tensor, torch.nn.Parameter) or attr not in owner._buffers:
            setattr(owner, attr, done[id(tensor)])
        else:
            owner.register_buffer(attr, done[id(tensor)], persistent=attr not in owner._non_persistent_buffers_set)


def _where(node: Node) -> str:
    """The value a collective moves, as its error names it (formatted once, here, never per call)."""
    if node.op == "placeholder":
        return f"input {node.name}"
    if node.op == "get_attr":
        return f"parameter {node.target}"
    return f"{node.name} ({node.target}) in {module_path(node) or 'the top-level module'}"


def summed_where(members: list) -> str:
    """The parameters one gradient sum covers, as its error names them (the first three, then a count)."""
    return " and ".join(_where(m) for m in members[:3]) + (f" and {len(members) - 3} more" if len(members) > 3 else "")


def _sum_gradients(graph: torch.fx.Graph, members: list, layouts: list, rank: int, world: int, group: str) -> list:
    """One backward all-reduce sums the gradients of these parameters where ranks hold parts of them: units
    shared by several ranks (vLLM's replicated KV heads; a multi-query projection's weight and bias together),
    or replicated parameters that sharded ops read (``layouts``: S(0/1), one unit every rank holds).  Returns
    the nodes to read each parameter through, in order; their backward runs once all of them have gradients."""
    for member in members[1:]:  # side by side (a get_attr reads nothing), so the sum can follow them
        members[0].append(member)
    last = members[0]
    while last.next in members:
        last = last.next
    where = summed_where(members)
    with graph.inserting_after(last):
        summed = graph.call_function(collectives.sum_group_grads, (list(members), layouts, rank, world, group, where))
    items = []
    for i, member in reversed(list(enumerate(members))):
        with graph.inserting_after(summed):
            items.append(graph.call_function(operator.getitem, (summed, i)))
        items[-1].meta = dict(member.meta)
    return items[::-1]


def _layout(shard: Shard, node: Node) -> tuple:
    return shard.dim, shard.chunks, shard.units, shard.of, shard.groups, full_size(node, shard.dim)


class _TokenSizes:
    """A token dim's full length at run time, read off the input that it sizes (made when first needed)."""

    def __init__(self, graph: torch.fx.Graph):
        self.graph, self.made = graph, {}
        self.sources = token_inputs(graph)
        self.last_input = [n for n in graph.nodes if n.op == "placeholder"][-1:]

    def get(self, size):
        """The node for symbolic ``size`` if it is an input's dim, else ``size`` itself."""
        if not isinstance(size, torch.SymInt) or not size.node.expr.is_Symbol:
            return size
        name = str(size.node.expr)
        if name not in self.made and name in self.sources:
            node, dim = self.sources[name]
            with self.graph.inserting_after(self.last_input[0]):
                self.made[name] = self.graph.call_function(SIZE, (node, dim))
            self.made[name].meta["val"] = size
        return self.made.get(name, size)


def _gathered_both_ways(gm: torch.fx.GraphModule, choice: dict, grad: set) -> set:
    """Split values gathered whole both for sharded ops (whose gradients come back as partial sums) and for
    others (the output, replicated ops): one all-gather serves both, as the plan counts it."""
    readers: dict = {}
    for node in gm.graph.nodes:
        strategy = choice.get(node)
        wants = strategy.inputs if strategy is not None else [R] * len(input_slots(node))
        if strategy is None and node.op != "output":
            continue
        for src, want in zip(input_slots(node), wants, strict=True):
            if src in choice and isinstance(want, Replicate) and isinstance(choice[src].output, Shard):
                f = strategy is not None and partial_grad(node, strategy, want) and src in grad
                readers.setdefault(src, set()).add(f)
    return {src for src, flags in readers.items() if flags == {True, False}}


def rewrite(
    gm: torch.fx.GraphModule,
    choice: dict[Node, Strategy],
    tp: Group,
    *,
    dispatch: Groups | None = None,
    device: torch.device | None = None,
    provided: frozenset[str] = frozenset(),
    gather_outputs: bool = True,
    regathered: Collection[Node] | None = None,
) -> torch.fx.GraphModule:
    """Mutates ``gm`` (a fresh capture) into rank ``tp.rank``'s sharded program over the TP group ``tp``; expert
    segments that the plan routes, or that a mesh's "ep" ranks share (``dispatch``), are run by their experts'
    owners (runtime/expert_dispatch.py).  The pieces go to ``device``; the tensors in ``provided`` (a checkpoint's)
    and those on the meta device are left for runtime/materialize.py to fill.  Tokens gathered from the tensors in
    ``regathered`` (None: from every tensor) keep this rank's piece for the backward, gathered again there; the
    others are saved gathered."""
    rank, world, group = tp.rank, tp.size, tp.name
    dispatched = _dispatched(gm, choice, tp, dispatch or Groups(tp))
    graph = gm.graph
    grad = needs_grad(gm)
    placed: dict = {}  # node -> placement of its local value
    converted: dict = {}  # (node, placement, with f) -> node holding that version

    token_sizes = _TokenSizes(graph)

    summed_gathers = _gathered_both_ways(gm, choice, grad)

    def convert(src: Node, want, before: Node, reduce_grad: bool) -> Node:
        key = (src, want, reduce_grad)
        if key not in converted and src in summed_gathers and not reduce_grad:
            # read whole by sharded ops too: one all-gather whose backward reduce-scatters; this reader's whole
            # gradient enters that sum as 1/N on each rank (it is the same on every rank)
            gathered = convert(src, want, before, True)
            with graph.inserting_after(gathered):
                converted[key] = graph.call_function(collectives.scale_grad, (gathered, 1 / world))
            converted[key].meta["val"] = src.meta["val"]
        if key not in converted:
            value = src
            shape = getattr(src.meta["val"], "shape", None)  # None: a multi-output op's tuple, never converted
            if shape is not None:  # a sharded token dim's length is read at run time
                split = {p.dim for p in (placed[src], want) if isinstance(p, Shard)}
                shape = [token_sizes.get(n) if d in split else n for d, n in enumerate(shape)]
            again = regathered is None or src in regathered
            steps = collectives.conversion_steps(
                placed[src], want, shape, rank, world, group, reduce_grad, _where(src), again
            )
            with graph.inserting_before(before):
                for fn, extra in steps:
                    value = graph.call_function(fn, (value, *extra))
                    value.meta["val"] = src.meta["val"]  # full-size metadata, like every other node
            converted[key] = value
        return converted[key]

    params = {}
    for members in gradient_sums(gm, choice, world):
        layouts = [_layout(choice[m].output, m) for m in members]
        for member, item in zip(members, _sum_gradients(graph, members, layouts, rank, world, group), strict=True):
            member.replace_all_uses_with(item, delete_user_cb=lambda user, keep=item.args[0]: user is not keep)
            placed[item] = choice[member].output
    for members in partial_params(gm, choice, grad):  # read as replicated by sharded ops: where those read them
        layouts = [_layout(Shard(0, units=1), m) for m in members]
        for member, item in zip(members, _sum_gradients(graph, members, layouts, rank, world, group), strict=True):
            converted[(member, R, True)] = item
    for node in list(graph.nodes):
        if node.op == "get_attr" and node in choice:
            placed[node] = params[node.target] = choice[node].output
        elif node.op == "placeholder" and node in choice:
            placed[node] = R
        elif node.op == "output":
            node.args = map_arg(
                node.args,
                lambda n, out=node: (
                    convert(n, R, out, False)
                    if n in placed
                    and isinstance(placed[n], (Replicate, Partial, Shard))
                    and (gather_outputs or not isinstance(placed[n], Shard))
                    else n
                ),
            )
        elif node in choice:
            strategy = choice[node]
            wants = iter(strategy.inputs)

            def swap(n: Node, node=node, strategy=strategy, wants=wants) -> Node:
                want = next(wants)
                if n not in placed or want is None:
                    return n
                f = partial_grad(node, strategy, want) and n in grad
                return convert(n, want, node, f)

            node.args, node.kwargs = map_arg((node.args, node.kwargs), swap)
            local = op(node.target).local
            if local is not None:
                local(node, strategy, rank, world)
            placed[node] = strategy.output
        elif node.target == SIZE:
            src, dim = node.args
            p = placed.get(src)
            if isinstance(p, Shard) and p.dim == dim % src.meta["val"].dim():
                full = token_sizes.get(src.meta["val"].shape[p.dim])
                if not isinstance(full, Node):
                    raise RuntimeError(f"{node.name} reads the size of sharded dim {dim}: rules must not allow this")
                node.replace_all_uses_with(full)  # the full length, not this rank's piece's
    graph.lint()
    if any(node.target is collectives.gather_tokens for node in graph.nodes):
        activations.keep_pieces(gm)
    dealt = {table.target: deal for segment, (deal, _) in dispatched.items() for table in segment.tables}
    shard_parameters(gm, params, rank, world, provided, device, dealt)
    for segment, (deal, copies) in dispatched.items():
        owners = [deal.experts.ranges(segment.experts, r, deal.group.size)[0] for r in range(deal.group.size)]
        expert_segments.dispatch(gm, segment, owners, deal.group, copies, _where(segment.exit))
    gm.autotp_dealt = dealt
    gm.recompile()
    return gm


def _dispatched(gm: torch.fx.GraphModule, choice: dict, tp: Group, dispatch: Groups) -> dict:
    """segment -> (how its tables are dealt over the group its rows are dispatched over, the TP ranks among
    them holding the same rows or None): the segments the plan routes, over the routed group; with a mesh's
    "ep" ranks every other one too, over them."""
    found = {}
    world = tp.size
    for segment in expert_segments.find(gm, Context(world=world, ops=TABLE)):
        held = choice[segment.exit].output
        if isinstance(held, Routed):
            over, copies, experts = dispatch.routed, tp if world > 1 else None, held.experts
        elif dispatch.ep is not None:
            over, copies, experts = dispatch.ep, None, Shard(0, units=segment.experts)
        else:
            continue
        found[segment] = (Dealt(experts, segment.experts, over), copies)
    return found
