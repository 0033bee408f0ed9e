"""``autotp.parallelize``: tensor parallelism on one group, or on the "tp" dimension of a DeviceMesh
composed with data parallelism ("dp") and pipeline stages ("pp").

A mesh names its dimensions from ("pp", "dp", "tp"), outer to inner, so the ranks of a TP group are
consecutive (inside a node) and DP and PP groups span nodes, as Megatron and torchtitan lay them out.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autotp import api
from autotp.runtime.materialize import materialize

from .data import check_kind, data_parallel

DIMS = ("pp", "dp", "tp")


def mesh_dims(mesh: DeviceMesh) -> tuple[str, ...]:
    """The mesh's dimension names, checked: a subset of ("pp", "dp", "tp") in that order."""
    names = tuple(mesh.mesh_dim_names or ())
    ordered = tuple(d for d in DIMS if d in names)
    if len(names) != mesh.ndim or names != ordered or len(set(names)) != len(names):
        raise ValueError(f"mesh dimensions {names or '(unnamed)'}: name them from {DIMS}, outer to inner, each at most "
                         "once, e.g. init_device_mesh('cuda', (2, 8), mesh_dim_names=('dp', 'tp'))")
    return names


def parallelize(model: torch.nn.Module, args=None, kwargs=None, *, mesh: DeviceMesh | None = None,
                data_parallel: str = "fsdp", loss_fn=None, schedule: str = "1f1b", microbatches: int | None = None,
                stages=None, **options):
    """This rank's parallel copy of ``model``.

    Without ``mesh``: tensor parallelism over ``group`` (default: every rank), exactly
    ``autotp.api.tensor_parallel(model, args, kwargs, **options)``.  With ``mesh``: autotp's plan on the
    "tp" sub-group, then FSDP2 ``fully_shard`` (``data_parallel="ddp"``: DDP) over the "dp" sub-group;
    the result has the model's call signature and parameter names.  A "pp" dimension splits the model
    into pipeline stages (``loss_fn(output, target)`` required; ``schedule``, ``microbatches`` and
    ``stages`` choose the schedule, micro-batches and stage boundaries) and returns a pipeline with
    ``step(*inputs, target=..., losses=[])``.  ``args`` are one DP rank's share of the batch.
    """
    if mesh is None:
        return api.tensor_parallel(model, args, kwargs, **options)
    dims = mesh_dims(mesh)
    _check_size(mesh, dims)
    if options.get("group") is not None:
        raise ValueError("pass either mesh= or group=, not both: with a mesh, TP runs on its 'tp' dimension")
    check_kind(data_parallel)
    shard_stage = functools.partial(_shard, mesh=mesh, kind=data_parallel, options=options)
    if "pp" in dims:
        if loss_fn is None:
            raise ValueError("a mesh with a 'pp' dimension needs loss_fn(output, target): the last stage computes it")
        try:
            from .pipeline import pipeline
        except ModuleNotFoundError as exc:
            if exc.name != f"{__package__}.pipeline":
                raise
            raise NotImplementedError("pipeline stages ('pp' in the mesh) are not available in this build of autotp: "
                                      "use a mesh of 'dp' and 'tp' only") from exc
        return pipeline(model, args, kwargs, mesh=mesh, loss_fn=loss_fn, schedule=schedule,
                        microbatches=microbatches, stages=stages, shard_stage=shard_stage, data_parallel=data_parallel,
                        topology=options.get("topology"), memory_limit=options.get("memory_limit"))
    if loss_fn is not None or microbatches is not None or stages is not None:
        raise ValueError("loss_fn, microbatches and stages are for pipeline stages: add a 'pp' dimension to the mesh, "
                         "or drop them")
    return shard_stage(model, args, kwargs)


def _check_size(mesh: DeviceMesh, dims: tuple) -> None:
    """Every process is in the mesh (a rank outside it would wait forever for the others)."""
    if not dist.is_initialized():
        return
    sizes = [mesh[d].size() for d in dims]
    if math.prod(sizes) != dist.get_world_size():
        shown = " x ".join(f"{d} {n}" for d, n in zip(dims, sizes, strict=True))
        raise ValueError(f"the mesh's dimensions ({shown}) multiply to {math.prod(sizes)} ranks, but the world has "
                         f"{dist.get_world_size()}: make their sizes multiply to the number of processes started")


def _shard(model: torch.nn.Module, args, kwargs, *, mesh: DeviceMesh, kind: str, options: dict,
           graph=None, fixed: dict | None = None) -> torch.nn.Module:
    """TP on this rank's "tp" group (a group of this rank alone when the mesh has none), then DP on its
    "dp" group; the tensors a checkpoint or ``init_seed`` provides are filled once FSDP2 has split them, so each
    rank reads only its own piece.

    The pipeline passes each stage's graph here (``graph``, with ``fixed`` placements for its tied weights): one
    code path with and without stages."""
    dims = mesh.mesh_dim_names
    group = mesh["tp"].get_group() if "tp" in dims else _own_group()  # one rank: autotp still plans and keeps
    replicas = "dp" in dims and mesh["dp"].size() > 1                # its bookkeeping (everything replicated)
    fixed = {**(fixed or {}), **(options.get("fixed") or {})} or None
    source = api.checkpoint_source(options.get("checkpoint"), model)
    later = replicas and kind == "fsdp"
    sharded = api.tensor_parallel(model, args, kwargs, group=group, graph=graph, fill=not later,
                                  **{**options, "fixed": fixed, "checkpoint": source})
    sharded.autotp_mesh = mesh
    if replicas:
        sharded = data_parallel(sharded, mesh["dp"], kind)
    if later and (source is not None or options.get("init_seed") is not None):
        materialize(sharded, checkpoint=source, seed=options.get("init_seed"))
    return sharded


def _own_group():
    """A group of this rank alone, created by this rank only (no collective over the others)."""
    return dist.new_group([dist.get_rank()], use_local_synchronization=True)
