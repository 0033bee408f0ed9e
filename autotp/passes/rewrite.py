"""Rewrite the captured graph into this rank's program: local shards, explicit collectives,
and size arguments of view/reshape/expand/split adjusted to local shapes."""
from __future__ import annotations

import math
import operator

import torch
from torch.fx import Node
from torch.fx.node import map_arg

from autotp.runtime import activations, collectives, local_ops
from autotp.runtime.placement import Disjoint, Partial, R, Replicate, Shard, take_local

from .capture import module_path
from .expert_rules import GROUPED_MM_FALLBACK, is_grouped_mm, offsets
from .layout_rules import block_of, constant_positions, cut_range, gathered
from .rules import held_heads
from .strategies import adds_once, gradient_sums, is_observer, needs_grad, partial_grad, partial_params

aten = torch.ops.aten


def _full_size(node: Node, dim: int) -> int:
    return int(node.meta["val"].shape[dim])


def _local_sizes(sizes, placement, rank: int, world: int):
    """A size list with the sharded dim cut to this rank's piece (-1 is left to infer)."""
    if not isinstance(placement, Shard):
        return sizes
    sizes = list(sizes)
    size = sizes[placement.dim]
    if isinstance(size, Node):
        raise AssertionError(f"sharded dim {placement.dim} has a symbolic size: rules must not allow this")
    if size != -1:
        sizes[placement.dim] = placement.local_size(size, rank, world)
    return sizes


def _localize(node: Node, strategy, rank: int, world: int) -> None:
    """Size arguments that describe a sharded dim must describe the local shard instead."""
    target = node.target
    src = strategy.inputs[0] if strategy.inputs else None
    if target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
                  aten.broadcast_to.default):
        node.args = (node.args[0], _local_sizes(node.args[1], strategy.output, rank, world), *node.args[2:])
    elif target == aten.index.Tensor and isinstance(src, Shard) and cut_range(node) is None and \
            (found := constant_positions(node)) is not None and found[0] == src.dim:
        at, positions = found  # a gather along the sharded dim: this rank's heads, from its piece
        local = gathered(src, strategy.output, positions, node.args[0].meta["val"].shape[at], rank, world)
        node.target, node.args, node.kwargs = local_ops.gather_positions, (node.args[0], at, tuple(local)), {}
    elif target in (aten.slice.Tensor, aten.index.Tensor) and isinstance(src, Shard) and src.chunks:
        bounds = cut_range(node)  # one whole block of a fused dim: its range in the local layout
        if bounds is None and target == aten.index.Tensor:
            raise RuntimeError(f"{node.name} indexes a fused dim the plan splits block by block, but its positions "
                               "are not known in this capture (a constant on the meta device?): plan with this model")
        k = block_of(src, *bounds[1:]) if bounds and bounds[0] == src.dim else None
        if k is not None:
            lengths = [n for _, n in src.ranges(sum(src.chunks), rank, world)]
            start = sum(lengths[:k])
            node.target, node.kwargs = aten.slice.Tensor, {}
            node.args = (node.args[0], src.dim, start, start + lengths[k])
    elif target in (aten.split.Tensor, aten.split_with_sizes.default):
        at = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        if isinstance(src, Shard) and src.dim == at % node.args[0].meta["val"].dim():
            sizes = node.args[1]
            ranges = src.ranges(node.args[0].meta["val"].shape[src.dim], rank, world)
            local = [n for _, n in ranges] if isinstance(sizes, (list, tuple)) else ranges[0][1]
            node.args = (node.args[0], local, *node.args[2:])
    elif target == aten.repeat_interleave.self_int and isinstance(strategy.output, Shard):
        x, repeats, at = node.args[:3]
        kv, heads = x.meta["val"].shape[at], node.meta["val"].shape[at]
        in_start = held_heads(src, at, kv, rank, world)[0]
        (out_start, out_len), = strategy.output.ranges(heads, rank, world)
        node.target, node.args, node.kwargs = local_ops.repeat_heads, (x, repeats, at, in_start, out_start, out_len), {}
    elif target == aten.mean.dim and isinstance(src, Shard) and isinstance(strategy.output, Partial):
        x, dims = node.args[:2]
        shape = x.meta["val"].shape
        count = math.prod(int(shape[d]) for d in dims)
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        node.target, node.args = local_ops.partial_mean, (x, dims, keepdim, count)
        node.kwargs = {k: v for k, v in node.kwargs.items() if k == "dtype"}
    elif adds_once(node, strategy) and rank != 0:  # rank 0 alone adds the replicated operand
        at = strategy.inputs.index(R)
        with node.graph.inserting_before(node):
            zeros = node.graph.call_function(local_ops.added_by_rank0, (node.args[at],))
        zeros.meta = dict(node.args[at].meta)
        node.update_arg(at, zeros)
    elif isinstance(strategy.output, Disjoint) and (is_grouped_mm(node) or target == aten.index.Tensor):
        _own_experts(node, strategy, rank, world)
    elif target == aten.embedding.default and isinstance(src, Shard) and src.dim == 0:
        weight, ids = node.args[:2]
        (start, _), = src.ranges(weight.meta["val"].shape[0], rank, world)
        padding = node.args[2] if len(node.args) > 2 else -1
        node.target, node.args, node.kwargs = local_ops.vocab_embedding, (weight, ids, start, padding), {}


def _own_experts(node: Node, strategy, rank: int, world: int) -> None:
    """Expert parallelism: this rank's experts compute their own tokens' rows, zeros the others'."""
    weight = node.args[1] if is_grouped_mm(node) else node.args[0]
    first, _ = strategy.output.owned(_full_size(weight, 0), rank, world)
    if is_grouped_mm(node):
        fallback = str(node.target) == GROUPED_MM_FALLBACK
        node.target, node.args, node.kwargs = local_ops.expert_grouped_mm, (node.args[0], weight, offsets(node),
                                                                            first, fallback), {}
    else:
        (ids,) = node.args[1]
        node.target, node.args, node.kwargs = local_ops.expert_rows, (weight, ids, first), {}


def _attribute(gm: torch.nn.Module, target: str):
    owner, _, attr = target.rpartition(".")
    return getattr(gm.get_submodule(owner), attr, None)


def _written(gm: torch.fx.GraphModule) -> set:
    """Tensors of the module that the program writes in place (a KV cache): their start is zeros."""
    found = set()
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for arg, spec in zip(node.args, schema.arguments, strict=False):
            if isinstance(arg, torch.fx.Node) and arg.op == "get_attr" and spec.alias_info and spec.alias_info.is_write:
                found.add(arg.target)
    return found


def shard_parameters(gm: torch.fx.GraphModule, placements: dict, rank: int, world: int, checkpoint=None,
                     device: torch.device | None = None) -> None:
    """Give the module its own copy of every parameter and buffer, sharded as planned.

    From ``checkpoint`` (autotp.runtime.hf_checkpoint.Checkpoint) each rank reads only its slices; otherwise
    from the captured model's tensors, copied (never views) so that the user's model is untouched.
    Tied tensors stay tied.
    """
    from autotp.runtime.hf_checkpoint import CheckpointError, check_names, is_persistent

    tensors = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]
    known = {name for name, _ in tensors}
    constants = {node.target for node in gm.graph.nodes  # lifted tensor constants (a KV cache)
                 if node.op == "get_attr" and node.target not in known and isinstance(_attribute(gm, node.target),
                                                                                     torch.Tensor)}
    tensors += [(name, _attribute(gm, name)) for name in sorted(constants)]
    written = _written(gm)
    aliases: dict = {}
    for name, tensor in tensors:
        aliases.setdefault(id(tensor), []).append(name)
    by_id = {id(tensor): placements[name] for name, tensor in tensors if name in placements}
    if checkpoint is not None:
        persistent = {id(t): (aliases[id(t)], t.shape) for n, t in tensors if is_persistent(gm, n, t)}
        optional = {n for n, t in tensors if id(t) not in persistent}
        check_names(checkpoint, persistent, optional)
    done: dict = {}
    for name, tensor in tensors:
        owner_name, _, attr = name.rpartition(".")
        owner = gm.get_submodule(owner_name)
        if id(tensor) not in done:
            placement = by_id.get(id(tensor), R)
            stored = [n for n in aliases[id(tensor)] if checkpoint is not None and n in checkpoint.files]
            if stored:
                # copy: own memory, not pages of the mapped file (the optimizer writes into parameters)
                piece = checkpoint.read(stored[0], placement, rank, world)
                shares = getattr(checkpoint, "shares", False)  # another program's shards: the same memory
                local = piece if shares else piece.to(device=device, dtype=tensor.dtype, copy=True)
            elif tensor.is_meta and name in written:  # state the program fills itself (a KV cache)
                shape = _local_sizes(list(tensor.shape), placement, rank, world)
                local = torch.zeros(shape, dtype=tensor.dtype, device=device)
            elif tensor.is_meta and name in constants:  # e.g. x[..., [-2], :]'s positions: made up = wrong
                raise CheckpointError(f"{name} is a tensor the model's forward creates (such as index positions) "
                                      "and it was created on the meta device, so its values are unknown: build "
                                      "this model on a real device (its weights may still come from checkpoint=DIR)")
            elif tensor.is_meta:
                raise CheckpointError(f"{name} is on the meta device and no checkpoint provides it: pass "
                                      "checkpoint=DIR, or build the model with accelerate.init_empty_weights() "
                                      "so that computed buffers stay real")
            else:
                data = tensor.detach()
                local = (take_local(data, placement, rank, world) if isinstance(placement, Shard) else data).clone()
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
    where = " and ".join(_where(m) for m in members[:3]) + (f" and {len(members) - 3} more" if len(members) > 3 else "")
    with graph.inserting_after(last):
        summed = graph.call_function(collectives.sum_group_grads, (list(members), layouts, rank, world, group, where))
    items = []
    for i, member in reversed(list(enumerate(members))):
        with graph.inserting_after(summed):
            items.append(graph.call_function(operator.getitem, (summed, i)))
        items[-1].meta = dict(member.meta)
    return items[::-1]


def _layout(shard: Shard, node: Node) -> tuple:
    return shard.dim, shard.chunks, shard.units, shard.of, shard.groups, _full_size(node, shard.dim)


class _TokenSizes:
    """A token dim's full length at run time, read off the input that it sizes (made when first needed)."""

    def __init__(self, graph: torch.fx.Graph):
        self.graph, self.made = graph, {}
        self.inputs = [n for n in graph.nodes if n.op == "placeholder"]

    def get(self, size):
        """The node for symbolic ``size`` if it is an input's dim, else ``size`` itself."""
        if not isinstance(size, torch.SymInt) or not size.node.expr.is_Symbol:
            return size
        name = str(size.node.expr)
        if name not in self.made:
            for node in self.inputs:
                shape = [str(n.node.expr) if isinstance(n, torch.SymInt) else None
                         for n in getattr(node.meta.get("val"), "shape", ())]
                if name in shape:
                    with self.graph.inserting_after(self.inputs[-1]):
                        self.made[name] = self.graph.call_function(aten.sym_size.int, (node, shape.index(name)))
                    self.made[name].meta["val"] = size
                    break
        return self.made.get(name, size)


def rewrite(gm: torch.fx.GraphModule, choice: dict, rank: int, world: int, group: str,
            checkpoint=None, device: torch.device | None = None, gather_outputs: bool = True) -> torch.fx.GraphModule:
    """Mutates ``gm`` (a fresh capture) into this rank's sharded program."""
    graph = gm.graph
    grad = needs_grad(gm)
    placed: dict = {}      # node -> placement of its local value
    converted: dict = {}   # (node, placement, with f) -> node holding that version

    token_sizes = _TokenSizes(graph)

    def convert(src: Node, want, before: Node, reduce_grad: bool) -> Node:
        key = (src, want, reduce_grad)
        if key not in converted:
            value = src
            shape = getattr(src.meta["val"], "shape", None)  # None: a multi-output op's tuple, never converted
            if shape is not None:  # a sharded token dim's length is read at run time
                split = {p.dim for p in (placed[src], want) if isinstance(p, Shard)}
                shape = [token_sizes.get(n) if d in split else n for d, n in enumerate(shape)]
            steps = collectives.conversion_steps(placed[src], want, shape, rank, world, group, reduce_grad,
                                                 _where(src))
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
            node.args = map_arg(node.args, lambda n, out=node: convert(n, R, out, False) if n in placed and
                                isinstance(placed[n], (Replicate, Partial, Shard)) and
                                (gather_outputs or not isinstance(placed[n], Shard)) else n)
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
            _localize(node, strategy, rank, world)
            placed[node] = strategy.output
        elif is_observer(node) and node.target == aten.sym_size.int:
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
    shard_parameters(gm, params, rank, world, checkpoint, device)
    gm.recompile()
    return gm
