"""``autotp.parallelize``: tensor parallelism on one group, or on the "tp" dimension of a DeviceMesh
composed with data parallelism ("dp"), expert parallelism ("ep") and pipeline stages ("pp").

A mesh names its dimensions from ("pp", "dp", "ep", "tp"), outer to inner, so the ranks of a TP group are
consecutive (inside a node) and DP and PP groups span nodes, as Megatron and torchtitan lay them out.  "ep" is
data parallelism for everything but the experts (attention and dense layers see "dp" x "ep" replicas), while the
experts are dealt out over it and their rows sent to their owners by all-to-all: torchtitan's dp2ep, Megatron's
MoE parallel folding.  With experts="all-to-all" the experts are dealt over "ep" x "tp" (expert TP 1); otherwise
the TP plan may split each expert over "tp" (expert TP = TP).
"""

from __future__ import annotations

import datetime
import functools
import math
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autotp import api
from autotp.options import MeshOptions, PlanOptions, RunOptions, from_keywords
from autotp.parallel.data import check_kind, data_parallel
from autotp.passes.fold import find_fold
from autotp.runtime.materialize import materialize
from autotp.runtime.transport import describe

DIMS = ("pp", "dp", "ep", "tp")


def mesh_dims(mesh: DeviceMesh) -> tuple[str, ...]:
    """The mesh's dimension names, checked: a subset of ("pp", "dp", "ep", "tp") in that order."""
    names = tuple(mesh.mesh_dim_names or ())
    ordered = tuple(d for d in DIMS if d in names)
    if len(names) != mesh.ndim or names != ordered or len(set(names)) != len(names):
        raise ValueError(
            f"mesh dimensions {names or '(unnamed)'}: name them from {DIMS}, outer to inner, each at most "
            "once, e.g. init_device_mesh('cuda', (2, 8), mesh_dim_names=('dp', 'tp'))"
        )
    return names


def parallelize(model: torch.nn.Module, args=None, kwargs=None, *, mesh: DeviceMesh | None = None, **options):
    """This rank's parallel copy of ``model``; ``options``: the fields of PlanOptions, RunOptions and MeshOptions
    (autotp/options.py), sorted into those values here, once.

    Without ``mesh``: tensor parallelism over ``group`` (default: every rank).  With ``mesh``: autotp's plan on the
    "tp" sub-group, then FSDP2 ``fully_shard`` (``data_parallel="ddp"``: DDP) over the "dp" sub-group; the result
    has the model's call signature and parameter names.  A "pp" dimension splits the model into pipeline stages
    (``loss_fn(output, target)`` required; ``schedule``, ``virtual_stages``, ``microbatches`` and ``stages`` choose
    the schedule, micro-batches and stage boundaries) and returns a pipeline with ``step(*inputs, target=...,
    losses=[])``.  ``args`` are one DP rank's share of the batch.  Every collective over the mesh (TP, FSDP or
    DDP, a stage's send or receive) gives up after ``timeout`` seconds and raises a CollectiveError naming the
    mesh dimension.
    """
    planning, running, meshing = from_keywords(options)
    if mesh is None:
        if meshing != MeshOptions():
            raise ValueError(
                "data_parallel, loss_fn, schedule, microbatches, stages and virtual_stages compose a "
                "DeviceMesh: pass mesh=, or drop them"
            )
        return api.tensor_parallel(model, args, kwargs, planning, running)
    dims = mesh_dims(mesh)
    _check_size(mesh, dims)
    if running.group is not None:
        raise ValueError("pass either mesh= or group=, not both: with a mesh, TP runs on its 'tp' dimension")
    check_kind(meshing.data_parallel)
    if isinstance(mesh, DeviceMesh):  # (a stand-in mesh has no groups to remake)
        mesh = timed_mesh(mesh, running.timeout)
    blocks = find_fold(model, min_blocks=2)  # FSDP units: one per block of the repeated list, found on the model
    shard_stage = functools.partial(
        _shard,
        mesh=mesh,
        kind=meshing.data_parallel,
        planning=planning,
        running=running,
        blocks=blocks.path if blocks else None,
        pipelined="pp" in dims,
    )
    if "pp" in dims:
        if meshing.loss_fn is None:
            raise ValueError("a mesh with a 'pp' dimension needs loss_fn(output, target): the last stage computes it")
        try:
            from autotp.parallel.pipeline import pipeline
        except ModuleNotFoundError as exc:
            if exc.name != "autotp.parallel.pipeline":
                raise
            raise NotImplementedError(
                "pipeline stages ('pp' in the mesh) are not available in this build of autotp: "
                "use a mesh of 'dp' and 'tp' only"
            ) from exc
        return pipeline(model, args, kwargs, mesh=mesh, meshing=meshing, planning=planning, shard_stage=shard_stage)
    if meshing.pipelined():
        raise ValueError(
            "loss_fn, microbatches, stages and virtual_stages are for pipeline stages: add a 'pp' "
            "dimension to the mesh, or drop them"
        )
    return shard_stage(model, args, kwargs)


def _check_size(mesh: DeviceMesh, dims: tuple) -> None:
    """Every process is in the mesh (a rank outside it would wait forever for the others)."""
    if not dist.is_initialized():
        return
    sizes = [mesh[d].size() for d in dims]
    if math.prod(sizes) != dist.get_world_size():
        shown = " x ".join(f"{d} {n}" for d, n in zip(dims, sizes, strict=True))
        raise ValueError(
            f"the mesh's dimensions ({shown}) multiply to {math.prod(sizes)} ranks, but the world has "
            f"{dist.get_world_size()}: make their sizes multiply to the number of processes started"
        )


def _shard(
    model: torch.nn.Module,
    args,
    kwargs,
    *,
    mesh: DeviceMesh,
    kind: str,
    planning: PlanOptions,
    running: RunOptions,
    blocks: str | None = None,
    pipelined: bool = False,
    graph=None,
    fixed: dict | None = None,
) -> torch.nn.Module:
    """TP on this rank's "tp" group (a group of this rank alone when the mesh has none), experts dispatched
    over its "ep" group, then DP on its "dp" x "ep" group (experts on "dp" alone; FSDP units per block of the
    list at ``blocks``); the tensors a checkpoint or ``init_seed`` provides are filled once FSDP2 has split them,
    so each rank reads only its own piece.

    The pipeline passes each stage's graph here (``graph``, with ``fixed`` placements for its tied weights): one
    code path with and without stages."""
    dims = mesh.mesh_dim_names
    tp = mesh["tp"].get_group() if "tp" in dims else _own_group()  # one rank: autotp still plans, keeps its books
    ep = "ep" in dims and mesh["ep"].size() > 1
    replicas = tuple(d for d in ("dp", "ep") if d in dims and mesh[d].size() > 1)
    planning = replace(planning, fixed={**(fixed or {}), **(planning.fixed or {})} or None)
    source = api.checkpoint_source(running.checkpoint, model)
    later = bool(replicas) and kind == "fsdp"
    expert_groups = None
    if ep:
        routed = mesh[tuple(d for d in ("ep", "tp") if d in dims)].mesh.flatten().tolist()
        expert_groups = (mesh["ep"].get_group(), dist.new_group(routed, use_local_synchronization=True))
    sharded = api.tensor_parallel(
        model,
        args,
        kwargs,
        planning,
        replace(running, group=tp, checkpoint=source),
        graph=graph,
        expert_groups=expert_groups,
        fill=not later,
    )
    sharded.autotp_mesh = mesh
    if replicas and kind == "fsdp" and hasattr(sharded, "autotp_programs"):  # another program could not share them
        sharded.autotp_programs.most = 0
        sharded.autotp_programs.why_not = "FSDP2 shards this program's parameters over 'dp': pad or bucket inputs"
    if replicas:
        experts = set(getattr(sharded, "autotp_dealt", {})) if ep else set()
        sharded = data_parallel(
            sharded,
            mesh[replicas[0] if len(replicas) == 1 else replicas],
            kind,
            blocks,
            pipelined,
            experts=experts,
            expert_mesh=mesh["dp"] if "dp" in replicas else None,
        )
    if later and (source is not None or running.init_seed is not None):
        materialize(sharded, checkpoint=source, seed=running.init_seed)
    return sharded


def timed_mesh(mesh: DeviceMesh, seconds: float) -> DeviceMesh:
    """``mesh`` with each dimension's group made anew, by its members alone, with ``seconds`` as its timeout and
    named in autotp's errors.  DeviceMesh gives its sub-groups PyTorch's default timeout (30 minutes) whatever
    init_process_group was told, and gloo's send and receive keep the timeout a group was made with."""
    groups = []
    for dim in mesh.mesh_dim_names:
        ranks = dist.get_process_group_ranks(mesh[dim].get_group())
        group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=seconds), use_local_synchronization=True)
        describe(group, f"mesh dimension {dim!r} (ranks {ranks})")
        groups.append(group)
    return DeviceMesh.from_group(groups, mesh.device_type, mesh=mesh.mesh, mesh_dim_names=mesh.mesh_dim_names)


def _own_group():
    """A group of this rank alone, created by this rank only (no collective over the others)."""
    return dist.new_group([dist.get_rank()], use_local_synchronization=True)
