"""Data parallelism over the "dp" dimension of a mesh, by PyTorch's own engines.

autotp's tensor-parallel module holds plain local shards, identical on every rank of a DP group
(the same TP rank of each replica), so FSDP2 and DDP treat them as ordinary parameters:
  fsdp  ``fully_shard``: each shard is split again over the DP group (parameters, gradients and
        optimizer state); parameters are all-gathered for the step, gradients reduce-scattered;
  ddp   composable ``replicate`` (DDP without a wrapper, so parameter names stay the model's):
        gradients all-reduced.
Under FSDP each repeated block is its own unit, as torchtitan applies it: the TP program is cut into one
submodule per block (parallel/blocks.py), ``fully_shard`` goes on every block and then on the root (the
embedding, the head and whatever is not in a block), and each block prefetches its neighbour's all-gather (the
next block's in the forward, the previous one's in the backward).  So a rank holds a few blocks' gathered
parameters at a time instead of all of them (three in the forward, with FSDP2's kept all-gather output: measured in
tests/test_measured_memory.py).  A block is resharded after its forward unless the module is a
pipeline stage, which runs several micro-batches' forwards before their backwards (torchtitan:
``reshard_after_forward = not pp``).  Each unit's all-gather and reduce-scatter are FSDP's own collectives, given
through ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` so that one that fails or times out says which
unit and which mesh dimension it waited on.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autotp.parallel.blocks import block_units
from autotp.runtime.transport import failure

KINDS = ("fsdp", "ddp")


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"data_parallel={kind!r}: choose 'fsdp' (FSDP2 fully_shard) or 'ddp'")


def same_start(tensors: list, dp_mesh: DeviceMesh) -> None:
    """Every replica starts from DP rank 0's values, as DDP does at construction: FSDP2 keeps each
    rank's own piece, so replicas initialised differently would silently train different models.  Tensors on
    the meta device have no values yet: the same checkpoint or seed fills them on every replica."""
    with torch.no_grad():
        for dim in range(dp_mesh.ndim):
            group = dp_mesh.get_group(dim)
            for tensor in tensors:
                if not tensor.is_meta:
                    dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)


def data_parallel(
    module: torch.nn.Module,
    dp_mesh: DeviceMesh,
    kind: str = "fsdp",
    blocks: str | None = None,
    pipelined: bool = False,
    experts: set = frozenset(),
    expert_mesh: DeviceMesh | None = None,
) -> torch.nn.Module:
    """``module`` made data-parallel over ``dp_mesh`` in place (its class changes, names stay).  ``blocks``: the
    path of the model's repeated block list, whose blocks become FSDP units; ``pipelined``: the module is a
    pipeline stage (its blocks keep their parameters gathered between forward and backward).  ``experts``:
    parameter names of expert tables dealt over a mesh's "ep" dim, whose replicas are on ``expert_mesh`` alone
    (its "dp" dim; None: none): FSDP leaves them be, their gradients are summed over ``expert_mesh`` and, as
    every replica's loss counts once, divided by the replicas of the rest (torchtitan's gradient divide factor
    for experts); the all-to-all's backward has already summed the "ep" ranks' tokens."""
    check_kind(kind)
    tables = {p for name, p in module.named_parameters() if name in experts}
    if kind == "ddp":
        if tables:
            raise NotImplementedError(
                'data_parallel="ddp" with an "ep" mesh dimension: use "fsdp" (experts are kept out of its sharding)'
            )
        from torch.distributed._composable.replicate import replicate

        return replicate(module, process_group=dp_mesh.get_group())
    from torch.distributed.fsdp import fully_shard

    own = {id(t) for t in tables}
    same_start([t for t in [*module.parameters(), *module.buffers()] if id(t) not in own], dp_mesh)
    if expert_mesh is not None:
        same_start(list(tables), expert_mesh)
    for table in tables:
        table.register_post_accumulate_grad_hook(
            functools.partial(_sum_expert_grad, group=expert_mesh and expert_mesh.get_group(), replicas=dp_mesh.size())
        )
    ignored = tables or None
    paths = block_units(module, blocks) if blocks else []
    units = [
        fully_shard(
            module.get_submodule(path), mesh=dp_mesh, reshard_after_forward=not pipelined, ignored_params=ignored
        )
        for path in paths
    ]
    sharded = fully_shard(module, mesh=dp_mesh, ignored_params=ignored)
    for unit, name in [*zip(units, paths, strict=True), (sharded, "the root unit (all but the blocks)")]:
        unit.set_custom_all_gather(_Named("FSDP all_gather", f"of the parameters of {name}"))
        unit.set_custom_reduce_scatter(_Named("FSDP reduce_scatter", f"of the gradients of {name}"))
    for before, after in itertools.pairwise(units):
        before.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([before])
    sharded.autotp_units = paths
    return sharded


class _Named:
    """FSDP2's default all-gather or reduce-scatter for one unit (its ``Comm`` protocol: ``allocate`` and a call);
    a failure raises autotp's CollectiveError naming the collective, the unit and the group."""

    def __init__(self, op: str, what: str):
        self.op, self.what = op, what

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op=None, async_op: bool = False):
        try:
            if self.op.endswith("all_gather"):
                return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
            return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        except Exception as exc:
            raise failure(self.op, self.what, group.group_name, exc) from exc


def _sum_expert_grad(table: torch.Tensor, group, replicas: int) -> None:
    if group is not None:
        dist.all_reduce(table.grad, group=group)
    table.grad.div_(replicas)
