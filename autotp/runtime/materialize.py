"""Memory and values for the tensors a sharded program holds on the meta device, each rank only its own piece.

A model built on the meta device goes through autotp with no weights: every parameter is this rank's local shape
on meta (torchtitan's idiom), FSDP2 splits it again over data parallelism, and ``materialize`` then gives each
tensor memory on the device, filled (tied names once) by the first source that has it:
  checkpoint  a safetensors directory (hf_checkpoint.Checkpoint): only this rank's piece is read, the TP piece cut
              again by FSDP2's split when the module is data-parallel;
  computed    a non-persistent buffer (a rotary table): rebuilt from the model's config (hf.computed_buffers);
  seed        the model's own initialisation of the full-shaped tensor on the CPU (transformers' ``_init_weights``
              of the tensor's module and its ancestors, as ``initialize_weights`` applies it, else the module's
              ``reset_parameters``), drawn from a generator seeded by (seed, the tensor's name), then cut to this
              rank's piece, so that every layout holds the same full model;
  otherwise   uninitialised memory (to fill with ``dcp.load``).
"""

from __future__ import annotations

import functools
import hashlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autotp.placement import R, Routed, fill_ranges, parse, piece_ranges
from autotp.runtime.conversion import CheckpointError, on_meta
from autotp.runtime.progress import step


def materialize(sharded, device=None, *, checkpoint=None, seed: int | None = None):
    """Fill the meta tensors of ``sharded`` (a module from ``autotp.parallelize``, or a pipeline's stages) on
    ``device`` (default: where ``parallelize`` placed the shards) from ``checkpoint``, the model's config (computed
    buffers) or its initialisation seeded by ``seed``; tensors none of them provides are left uninitialised.
    ``checkpoint``: a reader of pieces (hf_checkpoint.Checkpoint) or a directory that loads itself into the module
    (runtime/dcp_checkpoint.DcpDirectory)."""
    modules = [sharded] if isinstance(sharded, torch.nn.Module) else list(sharded.modules.values())
    reader = checkpoint if hasattr(checkpoint, "read_box") else None
    for module in modules:
        _fill(module, device or module.autotp_device, reader, seed)
        if checkpoint is not None and reader is None:  # a directory its own engine reads (runtime/dcp_checkpoint.py)
            checkpoint.load(module)
    return sharded


def _fill(module: torch.nn.Module, device: torch.device, checkpoint, seed: int | None) -> None:
    group, plan, model = module.autotp_group, module.autotp_plan, module.autotp_source
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    todo: dict = {}
    for name, tensor in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        if tensor.is_meta:
            todo.setdefault(id(tensor), (tensor, []))[1].append(name)
    if not todo:
        return
    if any(isinstance(tensor, DTensor) for tensor, _ in todo.values()):  # FSDP2's pieces: its own to_empty
        module._apply(lambda t: torch.empty_like(t, device=device) if isinstance(t, DTensor) and t.is_meta else t)
    canonical, skeleton = _canonical_names(model), on_meta(model) if seed is not None else model
    dealt = getattr(module, "autotp_dealt", {})  # expert tables dealt over a dispatch group: its experts first
    pieces = []
    for tensor, names in todo.values():
        placement, shape = _layout(plan, names, tensor)
        stored = next((n for n in names if checkpoint is not None and n in checkpoint.files), None)
        deal = next((dealt[n] for n in names if n in dealt), None)
        pieces.append(
            (
                tensor,
                names,
                shape,
                stored,
                piece_ranges(shape, placement, rank, world, _outer_box(tensor), deal.spans(shape[0]) if deal else None),
            )
        )
    computed = {
        names[0]: torch.empty(shape, dtype=tensor.dtype, device="meta")
        for tensor, names, shape, stored, _ in pieces
        if stored is None and not _persistent(module, names[0], tensor)
    }
    if computed:
        from autotp.runtime.hf_models import computed_buffers

        computed = computed_buffers(model, computed)
    with step("loading this rank's pieces", total=len(pieces)) as advance:
        for tensor, names, shape, stored, ranges in pieces:
            advance()
            if stored is not None and stored in getattr(checkpoint, "shared", ()):  # another program's: same memory
                _put(module, tensor, names, checkpoint.read_box(stored, None))
                continue
            if stored is not None:
                read = functools.partial(checkpoint.read_box, stored)
            elif names[0] in computed:
                read = functools.partial(_box, computed[names[0]])
            elif seed is not None:
                read = functools.partial(
                    _box, initialised(skeleton, canonical.get(names[0], names[0]), shape, tensor.dtype, seed)
                )
            else:
                read = None
            local = (
                tensor.to_local()
                if isinstance(tensor, DTensor)
                else torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            )
            if read is not None:
                with torch.no_grad():
                    fill_ranges(local, ranges, read)
            if not isinstance(tensor, DTensor):
                _put(module, tensor, names, local)


def _box(full: torch.Tensor, box: list) -> torch.Tensor:
    return full[tuple(box)]


def _put(module: torch.nn.Module, tensor: torch.Tensor, names: list, local: torch.Tensor) -> None:
    """``local`` in place of ``tensor`` under every name (tied names stay tied)."""
    if isinstance(tensor, torch.nn.Parameter):
        local = torch.nn.Parameter(local, requires_grad=tensor.requires_grad)
    for name in names:
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        if attr in owner._buffers:
            owner.register_buffer(attr, local, persistent=attr not in owner._non_persistent_buffers_set)
        else:
            setattr(owner, attr, local)


def _layout(plan, names: list, tensor: torch.Tensor) -> tuple:
    """(TP placement, full shape) of a tensor known by ``names``; one the plan does not list is whole."""
    for name in names:
        if name in plan.params:
            placement = parse(plan.params[name])
            return R if isinstance(placement, Routed) else placement, tuple(plan.shapes[name])
    return R, tuple(tensor.shape)


def _outer_box(tensor: torch.Tensor):
    """Per dim, (start, length) of the TP piece that FSDP2 keeps on this rank; None for a plain tensor."""
    if not isinstance(tensor, DTensor):
        return None
    (chunk,) = tensor.__create_chunk_list__()
    return list(zip(chunk.offsets, chunk.sizes, strict=True))


def _persistent(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> bool:
    owner, _, attr = name.rpartition(".")
    holder = module.get_submodule(owner)
    return isinstance(tensor, torch.nn.Parameter) or attr not in holder._non_persistent_buffers_set


def _canonical_names(model: torch.nn.Module) -> dict:
    """Every name of a tensor -> its first name in ``model`` (tied copies are seeded alike)."""
    first: dict = {}
    found = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        found[name] = first.setdefault(id(tensor), name)
    return found


def initialize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``model``'s parameters (in place) as ``materialize(..., seed=seed)`` fills any layout's pieces of them: the
    one-process model every layout equals."""
    skeleton = on_meta(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(initialised(skeleton, name, tuple(param.shape), param.dtype, seed))
    return model


def initialised(model: torch.nn.Module, name: str, shape: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The full tensor ``name`` of ``model`` (on the meta device: its initialisers touch nothing else) as the model's
    own initialisation makes it, on the CPU, from a generator seeded by (``seed``, ``name``): the same on every rank
    and in one process."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    slot = owner._parameters if attr in owner._parameters else owner._buffers
    held = slot[attr]
    full = torch.full(shape, float("nan"), dtype=dtype)
    slot[attr] = torch.nn.Parameter(full, requires_grad=False) if isinstance(held, torch.nn.Parameter) else full
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1)
            for init in _initialisers(model, owner_name):
                init()
    finally:
        slot[attr] = held
    if full.is_floating_point() and torch.isnan(full).any():
        raise CheckpointError(
            f"autotp cannot initialise {name}: neither the model's _init_weights nor its module's "
            "reset_parameters writes it; load it from a checkpoint (checkpoint=DIR)"
        )
    return full


def _initialisers(model: torch.nn.Module, path: str) -> list:
    """What initialises the tensors of module ``path``, in the order transformers' ``initialize_weights`` applies
    it (the module, then each ancestor: an ancestor may re-draw a child's weight, as GPT-2 scales its residual
    projections), each by its nearest transformers model's ``_init_weights``; a module outside any: its own
    ``reset_parameters``."""
    chain, module, owner = [("", model)], model, None
    for part in path.split(".") if path else []:
        module = getattr(module, part)
        chain.append((part, module))
    found = []
    for _, module in chain:
        if callable(getattr(module, "_initialize_weights", None)):  # a transformers model
            owner = module
        found.append((owner, module))
    if found[-1][0] is None:
        reset = getattr(chain[-1][1], "reset_parameters", None)
        return [reset] if callable(reset) else []
    return [
        lambda owner=owner, module=module: owner._init_weights(module)
        for owner, module in reversed(found)
        if owner is not None
    ]
