"""Model and optimizer state for ``torch.distributed.checkpoint`` (DCP), resharded on load.

DCP stores each tensor by its global shape and each rank's piece by its offset, so a checkpoint
written from TP2 x DP2 loads into TP4 or one process.  autotp's TP shards are plain local tensors
(and FSDP2 splits them again over the DP group), so the state dict from
``torch.distributed.checkpoint.state_dict`` is rewritten here: each tensor becomes a DTensor with
its global shape on the mesh (DP placement outer, TP placement inner).  DTensor's ``Shard`` deals out
equal ``torch.chunk`` pieces; autotp's uneven head splits, fused ``[q|k|v]`` blocks and heads shared by
several ranks have no DTensor placement, so those tensors are gathered and stored whole (exact; every
rank holds them in full in the state dict while saving or loading).  Every DTensor layout is checked
against the pieces the ranks really hold before it is used.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from autotp.placement import Routed, Shard, take_local
from autotp.runtime.expert_dispatch import Dealt
from autotp.runtime.hf_checkpoint import gather_whole


@dataclass(frozen=True)
class _Layout:
    """How one parameter (and its optimizer state) lies on this rank."""

    shard: Shard | None  # autotp's TP placement; None: replicated over TP
    shape: tuple  # the full tensor's shape
    fsdp: bool  # split again over DP by FSDP2 (dim 0 of the TP shard, torch.chunk pieces)
    dealt: Dealt | None = None  # an expert table's experts dealt over a dispatch group beyond the TP group first


def checkpoint_state_dict(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, **run_state) -> dict:
    """``{"model": ..., "optim": ..., "rng": ...}`` for ``dcp.save`` / ``dcp.load`` (a collective).

    Tensors have their full shapes (DTensors on the module's mesh, or whole tensors where no DTensor
    placement describes autotp's split), so the checkpoint loads into any other mesh or one process.
    Works on what ``autotp.parallelize`` returns on any mesh (a pipeline's stages on this rank by their
    full names), and on a plain module; a tied weight is stored once, under its first name.  "rng": the
    default generators, from which dropout draws its masks (every rank holds them in the same state).
    ``run_state``: the rest a resumed run needs, stored under its keyword: an object with ``state_dict``
    (a learning-rate scheduler, a data loader) or a plain value (the step count, the data position).
    """
    state = {"model": {}, "rng": _generators()}
    for stage, pieces, key, saved in _stages(module):
        state["model"].update(
            (key(n), pieces.to_global(n, t)) for n, t in get_model_state_dict(stage).items() if saved(n)
        )
    if optimizer is not None:
        state["optim"] = _Optimizer(module).state(optimizer)
    for name, value in run_state.items():
        state[name] = value.state_dict() if hasattr(value, "state_dict") else value
    return state


def load_checkpoint_state_dict(
    module: torch.nn.Module, state: dict, optimizer: torch.optim.Optimizer | None = None, **run_state
) -> None:
    """Put ``state`` (from ``checkpoint_state_dict``, filled by ``dcp.load``) into the module, the optimizer,
    the default generators and each object of ``run_state`` that has ``load_state_dict``."""
    for stage, pieces, key, _ in _stages(module):
        set_model_state_dict(
            stage,
            {
                n: t if key(n) is None else pieces.to_local(n, state["model"][key(n)])
                for n, t in get_model_state_dict(stage).items()
            },
        )
    if optimizer is not None:
        _Optimizer(module).load(optimizer, state["optim"])
    if "rng" in state:
        _set_generators(state["rng"])
    for name, value in run_state.items():
        if hasattr(value, "load_state_dict"):
            value.load_state_dict(state[name])


def _stages(module: torch.nn.Module) -> list:
    """(module, its _Pieces, name -> its key in the checkpoint, whether this name is saved) for each part that holds
    this rank's tensors: a pipeline's stages (``autotp_stages``, by the model's names; a buffer the model does not
    store has no key), or the module.  A tied weight's key is its first name, and only that name is saved (the
    copies two stages hold are one tensor of the checkpoint: DCP writes it once)."""
    stages = getattr(module, "autotp_stages", None)
    if stages is None:
        first = _first_names(module)
        return [(module, _Pieces(module), lambda n: first.get(n, n), lambda n: first.get(n, n) == n)]
    canonical, stored = module.autotp_canonical, module.stored
    key = lambda n: canonical(n) if n in stored else None  # noqa: E731
    return [(stage, _Pieces(stage), key, lambda n: key(n) is not None) for _, stage in sorted(stages.items())]


def _first_names(module: torch.nn.Module) -> dict:
    """name -> the first name of the same tensor (tied weights), for every parameter and buffer."""
    first: dict = {}
    for named in (module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)):
        seen: dict = {}
        for name, tensor in named:
            first[name] = seen.setdefault(id(tensor), name)
    return first


class _Optimizer:
    """The optimizer's state by the checkpoint's names, each tensor converted as its parameter is; a pipeline's
    stages are put under one module (``ModuleDict``: stage index, then the stage's own names) to read it."""

    def __init__(self, module: torch.nn.Module):
        self.parts = _stages(module)
        self.one = getattr(module, "autotp_stages", None) is None
        self.whole = module if self.one else torch.nn.ModuleDict({str(i): part[0] for i, part in enumerate(self.parts)})

    def _split(self, name: str) -> tuple:
        """(pieces, the part's own name, the checkpoint's key) of a name in ``self.whole``."""
        index, own = (0, name) if self.one else name.split(".", 1)
        _, pieces, key, _ = self.parts[int(index)]
        return pieces, own, key(own)

    def state(self, optimizer) -> dict:
        found = get_optimizer_state_dict(self.whole, optimizer)
        out: dict = {}
        for name, values in found["state"].items():
            pieces, own, key = self._split(name)
            out[key] = {k: pieces.to_global(own, v) if _param_shaped(v) else v for k, v in values.items()}
        groups = [
            {**g, "params": list(dict.fromkeys(self._split(n)[2] for n in g["params"]))} for g in found["param_groups"]
        ]
        return {"state": out, "param_groups": groups}

    def load(self, optimizer, saved: dict) -> None:
        mine = get_optimizer_state_dict(self.whole, optimizer)
        state = {}
        for name in mine["state"]:
            pieces, own, key = self._split(name)
            state[name] = {
                k: pieces.to_local(own, v) if _param_shaped(v) else v for k, v in saved["state"][key].items()
            }
        groups = [
            {**theirs, "params": ours["params"]}
            for ours, theirs in zip(mine["param_groups"], saved["param_groups"], strict=True)
        ]
        set_optimizer_state_dict(self.whole, optimizer, {"state": state, "param_groups": groups})


def _generators() -> bytes:
    """Every rank's default generators (CPU, and the GPU's in use), from which dropout draws its masks: each
    rank's own on the mesh it was saved from, the first rank's on another (ranks start them alike)."""
    mine = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        mine["cuda"] = torch.cuda.get_rng_state()
    everyone = [mine]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    buffer = io.BytesIO()
    torch.save(everyone, buffer)
    return buffer.getvalue()


def _set_generators(saved: bytes) -> None:
    everyone = torch.load(io.BytesIO(saved), weights_only=True)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = everyone[rank] if len(everyone) == world else everyone[0]
    torch.set_rng_state(mine["cpu"])
    if "cuda" in mine and torch.cuda.is_available():
        torch.cuda.set_rng_state(mine["cuda"])


class DcpDirectory:
    """A ``torch.distributed.checkpoint`` directory as ``checkpoint=``: ``checkpoint_state_dict``'s layout (the model
    under "model", beside the optimizer) or a plain model state dict, whichever holds the model's ``names``.
    ``files`` and ``shape`` name what it holds (checked before loading); ``load`` fills a module whose tensors have
    memory, each rank reading the pieces it holds (DCP's own reads; tensors no DTensor placement describes are
    read whole)."""

    def __init__(self, directory, names: frozenset):
        from torch.distributed.checkpoint import FileSystemReader

        self.directory = directory
        stored = {
            key: tuple(meta.size)
            for key, meta in FileSystemReader(str(directory)).read_metadata().state_dict_metadata.items()
            if hasattr(meta, "size")
        }
        model = {key.removeprefix("model."): size for key, size in stored.items() if key.startswith("model.")}
        self.nested = len(model.keys() & names) > len(stored.keys() & names)  # ``names``: the model's
        self.shapes = model if self.nested else stored
        self.files = dict.fromkeys(self.shapes)

    def shape(self, name: str) -> tuple:
        return self.shapes[name]

    def load(self, module: torch.nn.Module) -> None:
        import torch.distributed.checkpoint as dcp

        state = checkpoint_state_dict(module)
        dcp.load(state if self.nested else state["model"], checkpoint_id=str(self.directory))
        load_checkpoint_state_dict(module, state)


class _Pieces:
    """Where this rank's piece of every parameter lies in the full tensor, and the checkpoint's form of it."""

    def __init__(self, module: torch.nn.Module):
        plan = getattr(module, "autotp_plan", None)
        self.layouts: dict = {}
        if plan is None:  # a plain module: its state dict is already full tensors
            return
        self.group = module.autotp_group
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.mesh = getattr(module, "autotp_mesh", None)
        if self.mesh is not None and "pp" in self.mesh.mesh_dim_names:  # a pipeline stage: its place in dp x tp
            inner = tuple(d for d in self.mesh.mesh_dim_names if d != "pp")
            self.mesh = self.mesh[inner] if inner else None
        replicas = (
            ()
            if self.mesh is None
            else tuple(d for d in ("dp", "ep") if d in self.mesh.mesh_dim_names and self.mesh[d].size() > 1)
        )
        self.dp = self.mesh[replicas[0] if len(replicas) == 1 else replicas] if replicas else None  # FSDP2's mesh
        if self.mesh is None:  # TP alone: its group as a one-dimensional mesh
            self.mesh = DeviceMesh.from_group(self.group, module.autotp_device.type, mesh_dim_names=("tp",))
        dealt = getattr(module, "autotp_dealt", {})
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if name in plan.params:  # the rest (buffers no op reads) are whole on every rank
                shard, deal = plan.layout(name)[0], dealt.get(name)
                if isinstance(shard, Routed):  # whole experts: over the TP group alone, a split of it like any other
                    shard, deal = (shard.experts, None) if shard.ranks == self.world else (None, deal)
                self.layouts[name] = _Layout(
                    shard if isinstance(shard, Shard) else None,
                    tuple(plan.shapes[name]),
                    isinstance(tensor, DTensor),
                    deal,
                )
        self.placements = {
            name: None if layout.dealt else _dtensor_placements(self.mesh, layout)
            for name, layout in self.layouts.items()
        }

    def to_global(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's piece as a DTensor of the full shape, or the full tensor (a collective then)."""
        layout = self.layouts.get(name)
        if layout is None:
            return tensor
        if self.placements[name] is not None:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            return DTensor.from_local(
                local,
                self.mesh,
                self.placements[name],
                run_check=False,
                shape=torch.Size(layout.shape),
                stride=_strides(layout.shape),
            )
        size = None if layout.shard is None else layout.shape[layout.shard.dim]
        return gather_whole(tensor.detach(), (layout.shard, size, layout.dealt), self.group)

    def to_local(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Inverse of to_global: the form ``get_model_state_dict`` gives on this rank (an FSDP2 DTensor
        over the DP group, or the plain TP shard)."""
        layout = self.layouts.get(name)
        if layout is None:
            return tensor
        if isinstance(tensor, DTensor):
            piece = tensor.to_local()
        else:
            piece = tensor if layout.dealt is None else layout.dealt.local(tensor)
            piece = take_local(piece, layout.shard, self.rank, self.world) if layout.shard is not None else piece
            if layout.fsdp:
                last = self.dp.ndim - 1  # FSDP2 shards over its mesh's last dim (HSDP replicates over the first)
                piece = piece.narrow(0, *_chunk_range(piece.shape[0], self.dp.get_local_rank(last), self.dp.size(last)))
        if not layout.fsdp:
            return piece
        tp_shape = list(layout.shape)
        if layout.shard is not None:
            dim = layout.shard.dim
            tp_shape[dim] = layout.shard.local_size(tp_shape[dim], self.rank, self.world)
        return DTensor.from_local(
            piece.contiguous(),
            self.dp,
            [Replicate()] * (self.dp.ndim - 1) + [DShard(0)],
            run_check=False,
            shape=torch.Size(tp_shape),
            stride=_strides(tp_shape),
        )


def _param_shaped(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _strides(shape) -> tuple:
    return torch.empty(shape, device="meta").stride()


def _chunk_range(size: int, index: int, count: int) -> tuple[int, int]:
    """(start, length) of piece ``index`` of ``count`` along a dim of ``size``, as FSDP2 and DTensor cut it
    (torch.chunk: equal pieces rounded up, empty ones at the end)."""
    step = -(-size // count)
    start = min(index * step, size)
    return start, min(step, size - start)


def _dtensor_placements(mesh, layout: _Layout) -> tuple | None:
    """DTensor placements on ``mesh`` that put every rank's piece exactly where it lies in the full
    tensor, or None when there are none (checked for every mesh coordinate, so all ranks agree)."""
    if not set(mesh.mesh_dim_names) <= {"dp", "tp"}:
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
            if _compute_local_shape_and_global_offset(layout.shape, mesh.shape, coordinate, chosen) != _true_box(
                layout, dp_rank, dp, tp_rank, tp
            ):
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
