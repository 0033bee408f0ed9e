"""Data parallelism over the "dp" dimension of a mesh, by PyTorch's own engines.

autotp's tensor-parallel module holds plain local shards, identical on every rank of a DP group
(the same TP rank of each replica), so FSDP2 and DDP treat them as ordinary parameters:
  fsdp  ``fully_shard``: each shard is split again over the DP group (parameters, gradients and
        optimizer state); parameters are all-gathered for the step, gradients reduce-scattered;
  ddp   composable ``replicate`` (DDP without a wrapper, so parameter names stay the model's):
        gradients all-reduced.
The TP program is one fx graph whose forward never calls its submodules, so the whole module is one
FSDP unit (no per-block prefetch or resharding).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

KINDS = ("fsdp", "ddp")


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"data_parallel={kind!r}: choose 'fsdp' (FSDP2 fully_shard) or 'ddp'")


def same_start(tensors: list, dp_mesh: DeviceMesh) -> None:
    """Every replica starts from DP rank 0's values, as DDP does at construction: FSDP2 keeps each
    rank's own piece, so replicas initialised differently would silently train different models."""
    with torch.no_grad():
        for dim in range(dp_mesh.ndim):
            group = dp_mesh.get_group(dim)
            for tensor in tensors:
                dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)


def data_parallel(module: torch.nn.Module, dp_mesh: DeviceMesh, kind: str = "fsdp", experts: set = frozenset(),
                  expert_mesh: DeviceMesh | None = None) -> torch.nn.Module:
    """``module`` made data-parallel over ``dp_mesh`` in place (its class changes, names stay).  ``experts``:
    parameter names of expert tables dealt over a mesh's "ep" dim, whose replicas are on ``expert_mesh`` alone
    (its "dp" dim; None: none): FSDP leaves them be, their gradients are summed over ``expert_mesh`` and, as
    every replica's loss counts once, divided by the replicas of the rest (torchtitan's gradient divide factor
    for experts); the all-to-all's backward has already summed the "ep" ranks' tokens."""
    check_kind(kind)
    tables = {p for name, p in module.named_parameters() if name in experts}
    if kind == "ddp":
        if tables:
            raise NotImplementedError('data_parallel="ddp" with an "ep" mesh dimension: use "fsdp" (experts are '
                                      'kept out of its sharding)')
        from torch.distributed._composable.replicate import replicate
        return replicate(module, process_group=dp_mesh.get_group())
    from torch.distributed.fsdp import fully_shard
    own = {id(t) for t in tables}
    same_start([t for t in [*module.parameters(), *module.buffers()] if id(t) not in own], dp_mesh)
    if expert_mesh is not None:
        same_start(list(tables), expert_mesh)
    for table in tables:
        table.register_post_accumulate_grad_hook(functools.partial(_sum_expert_grad, group=expert_mesh and
                                                                   expert_mesh.get_group(), replicas=dp_mesh.size()))
    return fully_shard(module, mesh=dp_mesh, ignored_params=tables or None)


def _sum_expert_grad(table: torch.Tensor, group, replicas: int) -> None:
    if group is not None:
        dist.all_reduce(table.grad, group=group)
    table.grad.div_(replicas)
