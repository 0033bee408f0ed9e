"""Safetensors checkpoints: each rank reads only its own slices; saving gathers one tensor at a time.

Hugging Face layout: ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` files listed in
``model.safetensors.index.json``.  Tensor names are the model's parameter and persistent buffer names, or the names
transformers stores them under (its conversion mapping, see conversion.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from autotp.placement import Routed
from autotp.runtime.collectives import gather_full
from autotp.runtime.conversion import Assembled, CheckpointError, assemble, stored_layout

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class Checkpoint:
    """Lazy, sliceable view of a checkpoint directory (nothing is read until asked for).

    ``conversions``: transformers' conversion mapping of the model (``conversion.model_conversions``):
    stored names are renamed and per-expert tensors assembled as transformers does on load, so that
    ``files`` lists the model's tensor names."""

    def __init__(self, directory: str | Path, conversions: list = ()):
        self.directory = Path(directory)
        index, single = self.directory / INDEX, self.directory / SINGLE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif single.exists():
            with safe_open(single, framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), SINGLE)
        else:
            raise CheckpointError(f"no {SINGLE} or {INDEX} in {self.directory}")
        self.stored = {name: self.directory / file for name, file in weight_map.items()}
        self.files = (
            assemble(self.stored, conversions) if conversions else {name: Assembled.plain(name) for name in self.stored}
        )

    def shape(self, name: str) -> tuple:
        return self.files[name].shape(self._stored_shape)

    def _stored_shape(self, key: str) -> tuple:
        with safe_open(self.stored[key], framework="pt") as f:
            return tuple(f.get_slice(key).get_shape())

    def _read_stored(self, key: str, box: list) -> torch.Tensor:
        """The file is mapped for this one piece and unmapped after: a column slice touches every page
        of its tensor, and those pages must not stay resident once the piece is copied out."""
        with safe_open(self.stored[key], framework="pt") as f:
            return f.get_slice(key)[tuple(box)]

    def read_box(self, name: str, box: list) -> torch.Tensor:
        """One box (a ``slice`` per dim) of tensor ``name``, reading only its bytes (block by block for fused tensors,
        expert by expert for stacked ones); runtime/materialize.py writes a rank's piece from such boxes."""
        return self.files[name].read(box, self._stored_shape, self._read_stored)


def check_tensors(checkpoint: Checkpoint, module: torch.nn.Module, elsewhere: frozenset = frozenset()) -> None:
    """The checkpoint holds every parameter and persistent buffer of ``module`` (under one of its names) at its full
    shape; ``elsewhere``: names of the rest of the model (other pipeline stages), which it may hold too."""
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    aliases: dict = {}
    for name, tensor in tensors:
        aliases.setdefault(id(tensor), []).append(name)
    persistent = {id(t): (aliases[id(t)], t.shape) for n, t in tensors if is_persistent(module, n, t)}
    optional = {n for n, t in tensors if id(t) not in persistent} | set(elsewhere)
    check_names(checkpoint, persistent, optional)


def check_names(checkpoint: Checkpoint, expected: dict, optional: set = frozenset()) -> None:
    """``expected``: tensor id -> (alias names, full shape); ``optional``: names that may be present
    (non-persistent buffers).  One error names every problem."""
    problems = []
    known = set(optional)
    for names, shape in expected.values():
        present = [n for n in names if n in checkpoint.files]
        known.update(names)
        if not present:
            problems.append(f"missing: {names[0]}")
        elif checkpoint.shape(present[0]) != tuple(shape):
            problems.append(
                f"shape mismatch: {present[0]} is {checkpoint.shape(present[0])} in the checkpoint, "
                f"{tuple(shape)} in the model"
            )
    problems += [f"unexpected: {n}" for n in sorted(set(checkpoint.files) - known)]
    if problems:
        listed = "; ".join(problems[:12]) + (f"; and {len(problems) - 12} more" if len(problems) > 12 else "")
        raise CheckpointError(f"checkpoint {checkpoint.directory} does not match the model: {listed}")


def save_pretrained(sharded, directory: str | Path, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write a standard, unsharded checkpoint (a collective: every rank must call it).

    Tensors are gathered one at a time and rank 0 writes a file whenever ``max_shard_bytes`` is
    reached, so no rank ever holds the whole model; an index file lists them when there are several.
    A pipeline (``autotp.parallelize`` over a mesh with "pp") gathers its stages' parameters itself,
    and the first rank of the whole mesh writes them.  Every path writes the names and layout
    transformers' own ``save_pretrained`` writes for the model (conversion.py).
    """
    directory = Path(directory)
    if not isinstance(sharded, torch.nn.Module) and hasattr(sharded, "full_state_dict"):
        full = _stored(sharded, iter(sharded.full_state_dict(buffers=True).items()))
        _write(full, directory, max_shard_bytes, dist.get_rank() == 0, getattr(sharded, "autotp_config", None))
        dist.barrier()
        return directory
    mesh = getattr(sharded, "autotp_mesh", None)
    if mesh is not None and "pp" in mesh.mesh_dim_names:
        raise ValueError(
            "save_pretrained got one pipeline stage's module, which holds only that stage's parameters: "
            "save the pipeline as a whole"
        )
    _write(
        _stored(sharded, full_checkpoint_tensors(sharded)),
        directory,
        max_shard_bytes,
        _is_writer(sharded),
        getattr(sharded, "autotp_config", None),
    )
    dist.barrier(sharded.autotp_group if mesh is None else None)  # the writer may be in another TP group
    return directory


def _stored(sharded, named_tensors):
    """The names and per-expert layout transformers writes for the model ``sharded`` was made from, so that
    transformers' ``from_pretrained`` reads the directory."""
    source = getattr(sharded, "autotp_source", None)
    return named_tensors if source is None else stored_layout(source, named_tensors)


def _write(named_tensors, directory: Path, max_shard_bytes: int, writer: bool, config) -> None:
    """Consume (name, full tensor) pairs in order, writing files of at most ``max_shard_bytes`` on the writer
    (the others only take part in the gathers the pairs come from)."""
    if writer:
        directory.mkdir(parents=True, exist_ok=True)
    files, pending, pending_bytes, total = [], {}, 0, 0

    def flush():
        nonlocal pending, pending_bytes
        if writer and pending:
            path = directory / f"part-{len(files):05d}.safetensors"
            save_file(pending, path, metadata={"format": "pt"})
            files.append((path, list(pending)))
        pending, pending_bytes = {}, 0

    for name, full in named_tensors:
        if writer:
            size = full.numel() * full.element_size()
            if pending and pending_bytes + size > max_shard_bytes:
                flush()
            pending[name] = full.contiguous()
            pending_bytes += size
            total += size
    flush()
    if writer:
        _name_files(directory, files, total)
        if config is not None:
            config.save_pretrained(directory)


def _is_writer(sharded: torch.nn.Module) -> bool:
    """Rank 0 of the TP group writes; over a mesh, only the mesh's first rank (one copy, not one per replica)."""
    mesh = getattr(sharded, "autotp_mesh", None)
    if mesh is None:
        return dist.get_rank(sharded.autotp_group) == 0
    return dist.get_rank() == mesh.mesh.flatten()[0].item()


def gather_whole(tensor: torch.Tensor, layout: tuple, group) -> torch.Tensor:
    """The full tensor: gathered over data parallelism first (FSDP2 holds a DTensor of this rank's TP
    shard, split again over the DP group), then over the TP group (autotp's own placement), then, for an
    expert table dealt over a dispatch group (``layout``'s third item, runtime.expert_dispatch.Dealt), over it."""
    local = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    if local.dtype in _BYTES:  # FP8 weights travel as their bytes (gloo has no FP8 type)
        return gather_whole(local.view(torch.uint8), layout, group).view(local.dtype)
    placement, size, *dealt = layout
    full = gather_full(local, None if isinstance(placement, Routed) else placement, size, group)
    return dealt[0].gather(full) if dealt and dealt[0] is not None else full


_BYTES = {torch.float8_e4m3fn}


def is_persistent(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Parameters and persistent buffers are what a checkpoint holds."""
    owner, _, attr = name.rpartition(".")
    holder = module.get_submodule(owner)
    return isinstance(tensor, torch.nn.Parameter) or (
        attr in holder._buffers and attr not in holder._non_persistent_buffers_set
    )


def full_checkpoint_tensors(sharded: torch.nn.Module):
    """(name, full tensor) for every parameter and persistent buffer, gathered one at a time (a collective)."""
    placements = _placements_by_id(sharded)
    for name, tensor in _persistent_tensors(sharded):
        yield name, gather_whole(tensor, placements.get(id(tensor), (None, None)), sharded.autotp_group)


def _persistent_tensors(module: torch.nn.Module):
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if is_persistent(module, name, tensor):
            yield name, tensor


def _name_files(directory: Path, files: list, total: int) -> None:
    if len(files) == 1:
        files[0][0].rename(directory / SINGLE)
        return
    weight_map = {}
    for k, (path, names) in enumerate(files, start=1):
        final = f"model-{k:05d}-of-{len(files):05d}.safetensors"
        path.rename(directory / final)
        weight_map.update(dict.fromkeys(names, final))
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def _placements_by_id(sharded: torch.nn.Module) -> dict:
    plan, dealt = sharded.autotp_plan, getattr(sharded, "autotp_dealt", {})
    named = [*sharded.named_parameters(remove_duplicate=False), *sharded.named_buffers(remove_duplicate=False)]
    return {id(t): (*plan.layout(n), dealt.get(n)) for n, t in named if n in plan.params}


def full_state_dict(sharded: torch.nn.Module, grads: bool = False) -> dict:
    """Full (unsharded) parameters, or their gradients, by original name, on every rank (a collective
    over the TP group, and over the whole mesh when the module is also data-parallel).  A pipeline
    (``autotp.parallelize`` over a mesh with "pp") gathers its stages itself."""
    if not hasattr(sharded, "autotp_group") and hasattr(sharded, "full_state_dict"):
        if grads:
            raise ValueError("full_state_dict(grads=True) takes a module: gather each stage module's gradients")
        return sharded.full_state_dict()
    group = sharded.autotp_group
    placements = _placements_by_id(sharded)
    out = {}
    for name, param in sharded.named_parameters():
        tensor = param.grad if grads else param.detach()
        out[name] = None if tensor is None else gather_whole(tensor, placements.get(id(param), (None, None)), group)
    return out
