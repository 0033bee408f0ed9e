"""Model and optimizer state for ``torch.distributed.checkpoint`` (DCP), resharded on load.

DCP stores each tensor by its global shape and each rank's piece by its offset, so a checkpoint
written from TP2 x DP2 loads into TP4 or one process.  autotp's TP shards are plain local tensors
(and FSDP2 splits them again over the DP group), so the state dict from
``torch.distributed.checkpoint.state_dict`` is rewritten here: each tensor becomes a DTensor with
its global shape on the mesh (DP placement outer, TP placement inner).  DTensor's ``Shard`` deals out
equal ``torch.chunk`` pieces; autotp's uneven head splits, fused ``[q|k|v]`` blocks and heads shared by
several ranks have no DTensor placement, so those tensors are gathered and stored whole (exact; a
rank holds each such tensor in full while saving or loading).  Every DTensor layout is checked
against the pieces the ranks really hold before it is used.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from autotp.runtime.collectives import gather_full
from autotp.runtime.placement import Shard, take_local


@dataclass(frozen=True)
class _Layout:
    """How one parameter (and its optimizer state) lies on this rank."""
    shard: Shard | None  # autotp's TP placement; None: replicated over TP
    shape: tuple         # the full tensor's shape
    fsdp: bool           # split again over DP by FSDP2 (dim 0 of the TP shard, torch.chunk pieces)


def checkpoint_state_dict(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """``{"model": ..., "optim": ...}`` for ``dcp.save`` / ``dcp.load`` (a collective).

    Tensors have their full shapes (DTensors on the module's mesh, or whole tensors where no DTensor
    placement describes autotp's split), so the checkpoint loads into any other mesh or one process.
    Works on a module from ``autotp.parallelize`` (with or without a mesh) and on a plain module.
    """
    layouts = _layouts(module)
    state = {"model": {n: _to_global(module, layouts.get(n), t) for n, t in get_model_state_dict(module).items()}}
    if optimizer is not None:
        optim = get_optimizer_state_dict(module, optimizer)
        optim["state"] = {name: {k: _to_global(module, layouts.get(name), v) if _param_shaped(v) else v
                                 for k, v in values.items()} for name, values in optim["state"].items()}
        state["optim"] = optim
    return state


def load_checkpoint_state_dict(module: torch.nn.Module, state: dict,
                               optimizer: torch.optim.Optimizer | None = None) -> None:
    """Put ``state`` (from ``checkpoint_state_dict``, filled by ``dcp.load``) into the module and optimizer."""
    layouts = _layouts(module)
    set_model_state_dict(module, {n: _to_local(module, layouts.get(n), t) for n, t in state["model"].items()})
    if optimizer is not None:
        optim = dict(state["optim"])
        optim["state"] = {name: {k: _to_local(module, layouts.get(name), v) if _param_shaped(v) else v
                                 for k, v in values.items()} for name, values in optim["state"].items()}
        set_optimizer_state_dict(module, optimizer, optim)


def _param_shaped(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _layouts(module: torch.nn.Module) -> dict:
    plan = getattr(module, "autotp_plan", None)
    if plan is None:
        return {}
    found = {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if name in plan.params:  # the rest (buffers no op reads) are whole on every rank
            shard = plan.layout(name)[0]
            found[name] = _Layout(shard if isinstance(shard, Shard) else None, tuple(plan.shapes[name]),
                                  isinstance(tensor, DTensor))
    return found


def _tp(module: torch.nn.Module) -> tuple[int, int]:
    group = module.autotp_group
    return dist.get_rank(group), dist.get_world_size(group)


def _dp_mesh(module: torch.nn.Module):
    mesh = getattr(module, "autotp_mesh", None)
    return mesh["dp"] if mesh is not None and "dp" in mesh.mesh_dim_names else None


def _to_global(module: torch.nn.Module, layout: _Layout | None, tensor: torch.Tensor) -> torch.Tensor:
    """The checkpoint's form of this rank's piece: a DTensor of the full shape, or the full tensor."""
    if layout is None:
        return tensor
    placements = _dtensor_placements(module, layout)
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if placements is not None:
        mesh = module.autotp_mesh
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(layout.shape),
                                  stride=torch.empty(layout.shape, device="meta").stride())
    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return gather_full(whole, layout.shard, layout.shape[layout.shard.dim], module.autotp_group) \
        if layout.shard is not None else whole.detach().clone()


def _to_local(module: torch.nn.Module, layout: _Layout | None, tensor: torch.Tensor) -> torch.Tensor:
    """Inverse of _to_global: the form ``get_model_state_dict`` gives for this rank (an FSDP2 DTensor
    over the DP group, or the plain TP shard)."""
    if layout is None:
        return tensor
    if isinstance(tensor, DTensor):
        piece = tensor.to_local()
    else:
        rank, world = _tp(module)
        tp_piece = take_local(tensor, layout.shard, rank, world) if layout.shard is not None else tensor
        piece = _chunk(tp_piece, *_dp_coordinate(module)) if layout.fsdp else tp_piece
    if not layout.fsdp:
        return piece
    tp_shape = _tp_shape(module, layout)
    return DTensor.from_local(piece.contiguous(), _dp_mesh(module), [DShard(0)], run_check=False,
                              shape=torch.Size(tp_shape), stride=torch.empty(tp_shape, device="meta").stride())


def _dp_coordinate(module: torch.nn.Module) -> tuple[int, int]:
    mesh = _dp_mesh(module)
    return mesh.get_local_rank(), mesh.size()


def _chunk(tensor: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """Piece ``index`` of ``count`` along dim 0 as FSDP2 and DTensor cut it (torch.chunk; empty at the end)."""
    start, length = _chunk_range(tensor.shape[0], index, count)
    return tensor.narrow(0, start, length)


def _chunk_range(size: int, index: int, count: int) -> tuple[int, int]:
    step = -(-size // count)
    start = min(index * step, size)
    return start, min(step, size - start)


def _tp_shape(module: torch.nn.Module, layout: _Layout) -> tuple:
    if layout.shard is None:
        return layout.shape
    rank, world = _tp(module)
    shape = list(layout.shape)
    shape[layout.shard.dim] = layout.shard.local_size(shape[layout.shard.dim], rank, world)
    return tuple(shape)


def _dtensor_placements(module: torch.nn.Module, layout: _Layout) -> tuple | None:
    """DTensor placements on the module's mesh that put every rank's piece exactly where it lies in the
    full tensor, or None when there are none (checked for every mesh coordinate, so all ranks agree)."""
    mesh = getattr(module, "autotp_mesh", None)
    if mesh is None or not set(mesh.mesh_dim_names) <= {"dp", "tp"}:
        return None
    tp = mesh["tp"].size() if "tp" in mesh.mesh_dim_names else 1
    dp = mesh["dp"].size() if "dp" in mesh.mesh_dim_names else 1
    tp_placement = Replicate() if layout.shard is None else DShard(layout.shard.dim)
    dp_placement = Replicate()
    if layout.fsdp:
        stacked = layout.shard is not None and layout.shard.dim == 0  # TP splits dim 0 first, then FSDP
        dp_placement = _StridedShard(0, split_factor=tp) if stacked else DShard(0)
    placements = {"dp": dp_placement, "tp": tp_placement}
    chosen = tuple(placements[d] for d in mesh.mesh_dim_names)
    for dp_rank in range(dp):
        for tp_rank in range(tp):
            coordinate = [{"dp": dp_rank, "tp": tp_rank}[d] for d in mesh.mesh_dim_names]
            if _compute_local_shape_and_global_offset(layout.shape, mesh.shape, coordinate, chosen) != \
                    _true_box(layout, dp_rank, dp, tp_rank, tp):
                return None
    return chosen


def _true_box(layout: _Layout, dp_rank: int, dp: int, tp_rank: int, tp: int) -> tuple | None:
    """(shape, offset) of the piece a rank holds, from autotp's placement and FSDP2's split; None when
    it is not one box (fused blocks)."""
    shape, offset = list(layout.shape), [0] * len(layout.shape)
    if layout.shard is not None:
        ranges = layout.shard.ranges(shape[layout.shard.dim], tp_rank, tp)
        if len(ranges) != 1:
            return None
        offset[layout.shard.dim], shape[layout.shard.dim] = ranges[0]
    if layout.fsdp:
        start, shape[0] = _chunk_range(shape[0], dp_rank, dp)
        offset[0] += start
    if 0 in shape:  # DTensor reports an empty piece at the end of the dim
        offset = [layout.shape[d] if shape[d] == 0 else o for d, o in enumerate(offset)]
    return tuple(shape), tuple(offset)
