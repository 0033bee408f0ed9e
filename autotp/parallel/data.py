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

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

KINDS = ("fsdp", "ddp")


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"data_parallel={kind!r}: choose 'fsdp' (FSDP2 fully_shard) or 'ddp'")


def same_start(module: torch.nn.Module, dp_mesh: DeviceMesh) -> None:
    """Every replica starts from DP rank 0's values, as DDP does at construction: FSDP2 keeps each
    rank's own piece, so replicas initialised differently would silently train different models.  Tensors on
    the meta device have no values yet: the same checkpoint or seed fills them on every replica."""
    group, source = dp_mesh.get_group(), dp_mesh.mesh.flatten()[0].item()
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if not tensor.is_meta:
                dist.broadcast(tensor, src=source, group=group)


def data_parallel(module: torch.nn.Module, dp_mesh: DeviceMesh, kind: str = "fsdp") -> torch.nn.Module:
    """``module`` made data-parallel over ``dp_mesh`` in place (its class changes, names stay)."""
    check_kind(kind)
    if kind == "ddp":
        from torch.distributed._composable.replicate import replicate
        return replicate(module, process_group=dp_mesh.get_group())
    from torch.distributed.fsdp import fully_shard
    same_start(module, dp_mesh)
    return fully_shard(module, mesh=dp_mesh)
