"""Rewrite the captured graph into this rank's program: local shards, explicit collectives,
and size arguments of view/reshape/expand/split adjusted to local shapes."""
from __future__ import annotations

import torch
from torch.fx import Node
from torch.fx.node import map_arg

from autotp import collectives
from autotp.placement import Partial, R, Replicate, Shard, take_local

from .rules import block_of
from .strategies import is_observer, needs_grad

aten = torch.ops.aten


def _local_sizes(sizes, placement, world):
    """A size list with the sharded dim divided (-1 and symbolic sizes are left to infer)."""
    if not isinstance(placement, Shard):
        return sizes
    sizes = list(sizes)
    size = sizes[placement.dim]
    if isinstance(size, Node):
        raise AssertionError(f"sharded dim {placement.dim} has a symbolic size: rules must not allow this")
    if size != -1:
        sizes[placement.dim] = size // world
    return sizes


def _localize(node: Node, strategy, world: int) -> None:
    """Size arguments that describe a sharded dim must describe the local shard instead."""
    target = node.target
    if target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default):
        node.args = (node.args[0], _local_sizes(node.args[1], strategy.output, world), *node.args[2:])
    elif target == aten.slice.Tensor and isinstance(strategy.inputs[0], Shard) and strategy.inputs[0].chunks:
        shard = strategy.inputs[0]  # one whole block of a fused dim: its range in the local layout
        end = node.args[3] if len(node.args) > 3 and node.args[3] is not None else sum(shard.chunks)
        k = block_of(shard, node.args[2] or 0, min(end, sum(shard.chunks)))
        if k is not None and shard.dim == node.args[1] % node.args[0].meta["val"].dim():
            start = sum(shard.chunks[:k]) // world
            node.args = (node.args[0], node.args[1], start, start + shard.chunks[k] // world, *node.args[4:])
    elif target in (aten.split.Tensor, aten.split_with_sizes.default):
        src = strategy.inputs[0]
        at = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        if isinstance(src, Shard) and src.dim == at % node.args[0].meta["val"].dim():
            sizes = node.args[1]
            local = [s // world for s in sizes] if isinstance(sizes, (list, tuple)) else sizes // world
            node.args = (node.args[0], local, *node.args[2:])


def shard_parameters(gm: torch.fx.GraphModule, placements: dict, rank: int, world: int, checkpoint=None,
                     device: torch.device | None = None) -> None:
    """Give the module its own copy of every parameter and buffer, sharded as planned.

    From ``checkpoint`` (autotp.checkpoint.Checkpoint) each rank reads only its slices; otherwise
    from the captured model's tensors, copied (never views) so that the user's model is untouched.
    Tied tensors stay tied.
    """
    from autotp.checkpoint import CheckpointError, check_names, is_persistent

    tensors = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]
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
                local = piece.to(device=device, dtype=tensor.dtype, copy=True)
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
        if isinstance(tensor, torch.nn.Parameter):
            setattr(owner, attr, done[id(tensor)])
        else:
            owner.register_buffer(attr, done[id(tensor)], persistent=attr not in owner._non_persistent_buffers_set)


def rewrite(gm: torch.fx.GraphModule, choice: dict, rank: int, world: int, group: str,
            checkpoint=None, device: torch.device | None = None) -> torch.fx.GraphModule:
    """Mutates ``gm`` (a fresh capture) into this rank's sharded program."""
    graph = gm.graph
    grad = needs_grad(gm)
    placed: dict = {}      # node -> placement of its local value
    converted: dict = {}   # (node, placement, with f) -> node holding that version

    def convert(src: Node, want, before: Node, reduce_grad: bool) -> Node:
        key = (src, want, reduce_grad)
        if key not in converted:
            value = src
            with graph.inserting_before(before):
                for fn, extra in collectives.conversion_steps(placed[src], want, rank, world, group):
                    value = graph.call_function(fn, (value, *extra))
                if reduce_grad:
                    value = graph.call_function(collectives.reduce_grad, (value, group))
            converted[key] = value
        return converted[key]

    params = {}
    for node in list(graph.nodes):
        if node.op == "get_attr" and node in choice:
            placed[node] = choice[node].output
            params[node.target] = choice[node].output
        elif node.op == "placeholder" and node in choice:
            placed[node] = R
        elif node.op == "output":
            node.args = map_arg(node.args, lambda n, out=node: convert(n, R, out, False)
                                if n in placed and isinstance(placed[n], (Replicate, Partial, Shard)) else n)
        elif node in choice:
            strategy = choice[node]
            wants = iter(strategy.inputs)

            def swap(n: Node, node=node, strategy=strategy, wants=wants) -> Node:
                want = next(wants)
                if n not in placed or want is None:
                    return n
                f = isinstance(want, Replicate) and not strategy.replicated and n in grad
                return convert(n, want, node, f)

            node.args, node.kwargs = map_arg((node.args, node.kwargs), swap)
            _localize(node, strategy, world)
            placed[node] = strategy.output
        elif is_observer(node) and node.target == aten.sym_size.int:
            src, dim = node.args
            p = placed.get(src)
            if isinstance(p, Shard) and p.dim == dim % src.meta["val"].dim():
                raise RuntimeError(f"{node.name} reads the size of sharded dim {dim}: rules must not allow this")
    graph.lint()
    shard_parameters(gm, params, rank, world, checkpoint, device)
    gm.recompile()
    return gm
