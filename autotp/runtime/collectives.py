"""Placement changes at run time, as autograd functions (Megatron's conjugate pairs).

  P -> R   all-reduce forward,  identity backward     (Megatron's g)
  P -> S   reduce-scatter forward, all-gather backward
  R -> R*  identity forward,    all-reduce backward   (f: a replicated input of a sharded op)
  S -> R   all-gather forward,  local slice backward
  R -> S   local slice forward, all-gather backward
Uneven shards are padded to the largest piece for the collective.  Gradients of grouped shards
(KV heads shared by several ranks) are partial within each group, so "gathering" them sums.
CommDebugMode sees every collective; under torch.compile they are functional c10d ops, which it traces.
Every collective carries ``where`` (the rewrite's description of the value it moves): a collective that
fails or outlives the process group's timeout raises a ``CollectiveError`` naming it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx import Node
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autotp.placement import Partial, Replicate, Routed, Shard, assemble, take_local
from autotp.runtime import activations
from autotp.runtime.transport import all_reduce as all_reduce_sum
from autotp.runtime.transport import failed, pad, start_all_gather

_c10d = torch.ops._c10d_functional


def _lengths(shard: Shard, size: int, world: int) -> list[int]:
    return [shard.local_size(size, r, world) for r in range(world)]


def in_rank_order(shard: Shard, size: int, world: int) -> bool:
    """Rank r's piece is the r-th of ``world`` equal blocks: gathered and scattered without pads or reordering,
    in the form inductor's micro-pipeline TP pass fuses with the adjacent matmul (all-gather, wait, split, cat
    into the product; the product, split, cat into the reduce-scatter).  Uneven pieces are padded: not fused."""
    if size % world:
        return False
    n = size // world
    return all(shard.ranges(size, r, world) == [(r * n, n)] for r in range(world))


def gather_values(x: torch.Tensor, shard: Shard, size: int, world: int, group: str, where: str) -> torch.Tensor:
    """The full tensor from every rank's piece (owners' pieces for grouped shards)."""
    return start_gather(x, shard, size, world, group, where)()


def start_gather(
    x: torch.Tensor, shard: Shard, size: int, world: int, group: str, where: str
) -> Callable[[], torch.Tensor]:
    """``gather_values`` issued now; the function returned waits for it and puts the pieces together."""
    if in_rank_order(shard, size, world):  # the pieces stacked on dim 0, then side by side along the dim
        stacked = start_all_gather(x.contiguous(), world, group, where)
        if shard.dim == 0:
            return stacked
        return lambda: torch.cat(stacked().chunk(world), shard.dim)
    lengths = _lengths(shard, size, world)
    moved = pad(x.movedim(shard.dim, 0), max(lengths)).contiguous()
    started = start_all_gather(moved, world, group, where)

    def assembled() -> torch.Tensor:
        parts = [p[:n].movedim(0, shard.dim) for p, n in zip(started().chunk(world, 0), lengths, strict=True)]
        return assemble(parts, shard, size)  # concatenated along the dim itself: contiguous, like the input

    return assembled


def _embed(x: torch.Tensor, shard: Shard, size: int, rank: int, world: int) -> torch.Tensor:
    """Zeros of the full size with this rank's piece in place."""
    full = x.new_zeros(*x.shape[: shard.dim], size, *x.shape[shard.dim + 1 :])
    offset = 0
    for start, length in shard.ranges(size, rank, world):
        full.narrow(shard.dim, start, length).copy_(x.narrow(shard.dim, offset, length))
        offset += length
    return full


def _gather_grads(
    x: torch.Tensor, shard: Shard, size: int, rank: int, world: int, group: str, where: str
) -> torch.Tensor:
    """The full gradient from every rank's piece: pieces of a grouped shard are summed."""
    if shard.grouped(world):
        return all_reduce_sum(_embed(x, shard, size, rank, world), group, where)
    return gather_values(x, shard, size, world, group, where)


def _reduce_scatter(
    x: torch.Tensor, shard: Shard, size: int, rank: int, world: int, group: str, where: str
) -> torch.Tensor:
    lengths = _lengths(shard, size, world)
    even = in_rank_order(shard, size, world)
    if even:  # the ranks' blocks stacked on dim 0 straight from the product
        stacked = x.contiguous() if shard.dim == 0 else torch.cat(x.chunk(world, shard.dim))
    else:
        moved = x.movedim(shard.dim, 0)
        stacked = torch.cat([pad(take_local(moved, shard.at(0), r, world), max(lengths)) for r in range(world)])
    try:
        out = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(stacked.contiguous(), "sum", world, group))
    except Exception as exc:
        raise failed("reduce_scatter", x, where, exc, group) from exc
    return out if even else out[: lengths[rank]].movedim(0, shard.dim).contiguous()


def _owners_share(local: torch.Tensor, shard: Shard, size: int, rank: int, world: int) -> torch.Tensor:
    """A complete gradient piece, as a grouped value's gradient: of the ranks sharing a unit the first
    carries it, the others hold zeros there (their sum is the gradient)."""
    if not shard.grouped(world):
        return local
    share = torch.zeros_like(local)
    for offset, length in shard.claims(size, rank, world):
        share.narrow(shard.dim, offset, length).copy_(local.narrow(shard.dim, offset, length))
    return share


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard, size, rank, world, group, where):
        ctx.args = (shard, size, rank, world, group, where)
        return _reduce_scatter(x, shard, size, rank, world, group, where)

    @staticmethod
    def backward(ctx, grad):
        return _gather_grads(grad, *ctx.args), None, None, None, None, None, None


class _ReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, where):
        return all_reduce_sum(x, group, where)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, where):
        ctx.args = (group, where)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_sum(grad, *ctx.args), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard, size, rank, world, group, where):
        ctx.args = (shard, size, rank, world)
        return gather_values(x, shard, size, world, group, where)

    @staticmethod
    def backward(ctx, grad):
        shard, size, rank, world = ctx.args
        local = take_local(grad, shard, rank, world).contiguous()
        return _owners_share(local, shard, size, rank, world), None, None, None, None, None, None


class _GatherReduceBackward(torch.autograd.Function):
    """All-gather forward; reduce-scatter backward: a gathered input of a sharded op, whose gradient
    arrives as partial sums (Megatron's sequence-parallel pair, here on any sharded dim)."""

    @staticmethod
    def forward(ctx, x, shard, size, rank, world, group, where):
        ctx.args = (shard, size, rank, world, group, where)
        return gather_values(x, shard, size, world, group, where)

    @staticmethod
    def backward(ctx, grad):
        shard, size, rank, world, group, where = ctx.args
        local = _reduce_scatter(grad, shard, size, rank, world, group, where)
        return _owners_share(local, shard, size, rank, world), None, None, None, None, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard, size, rank, world, group, where):
        ctx.args = (shard, size, rank, world, group, where)
        return take_local(x, shard, rank, world).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather_grads(grad, *ctx.args), None, None, None, None, None, None


def _sum_shared(grads: list, layouts: list, rank: int, world: int, group: str, where: str) -> list:
    """Grouped parameters' gradients summed over the ranks sharing each unit, in one all-reduce of their
    shared blocks only (a fused [q|k|v] weight's query block is no rank's to share; a multi-query
    projection's weight and bias go together).  ``layouts``: (Shard, full size) per gradient."""
    jobs = []
    for grad, (shard, size) in zip(grads, layouts, strict=True):
        blocks = shard.blocks(size)
        ranges = shard.ranges(size, rank, world)
        offsets = [sum(blocks[:k]) for k in range(len(blocks))]
        pieces = list(grad.split([n for _, n in ranges], shard.dim))
        shared = [k for k, both in enumerate(shard.shared_blocks(world)) if both]
        full = []
        for k in shared:  # zeros of the whole block with this rank's units in place
            block = pieces[k].new_zeros(*grad.shape[: shard.dim], blocks[k], *grad.shape[shard.dim + 1 :])
            block.narrow(shard.dim, ranges[k][0] - offsets[k], ranges[k][1]).copy_(pieces[k])
            full.append(block)
        jobs.append((pieces, [ranges[k][0] - offsets[k] for k in shared], shared, full))
    flat = [f.reshape(-1) for *_, full in jobs for f in full]
    summed = iter(all_reduce_sum(torch.cat(flat), group, where).split([f.numel() for f in flat]))
    out = []
    for (pieces, starts, shared, full), (shard, _) in zip(jobs, layouts, strict=True):
        for k, start, f in zip(shared, starts, full, strict=True):
            pieces[k] = next(summed).view_as(f).narrow(shard.dim, start, pieces[k].shape[shard.dim])
        out.append(torch.cat(pieces, shard.dim).contiguous())
    return out


class _SumGroupGrads(torch.autograd.Function):
    """Identity forward; backward sums the gradients over the ranks sharing each unit (grouped weights)."""

    @staticmethod
    def forward(ctx, layouts, rank, world, group, where, *xs):
        ctx.args = (layouts, rank, world, group, where)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        return (None,) * 5 + tuple(_sum_shared(list(grads), *ctx.args))


def _no_grad() -> bool:
    """Inference (no_grad, generation): call the collective itself, without an autograd node."""
    return not torch.is_grad_enabled()


# Graph-callable forms: a Shard is passed as (dim, chunks, units, of, groups) so generated code can print it;
# ``where`` is the rewrite's description of the value, shown only when the collective fails.
def all_reduce(x, group, where):
    return all_reduce_sum(x, group, where) if _no_grad() else _ReduceForward.apply(x, group, where)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def scale_grad(x, factor):
    """Identity forward; the gradient scaled by ``factor`` (a whole gradient entering a reduce-scatter as 1/N)."""
    return x if _no_grad() else _ScaleGrad.apply(x, factor)


def reduce_grad(x, group, where):
    return x if _no_grad() else _ReduceBackward.apply(x, group, where)


def reduce_scatter(x, dim, chunks, units, of, groups, size, rank, world, group, where):
    shard = Shard(dim, chunks, units, of, groups)
    if _no_grad():
        return _reduce_scatter(x, shard, size, rank, world, group, where)
    return _ReduceScatter.apply(x, shard, size, rank, world, group, where)


def gather(x, dim, chunks, units, of, groups, size, rank, world, group, where):
    shard = Shard(dim, chunks, units, of, groups)
    return (
        gather_values(x, shard, size, world, group, where)
        if _no_grad()
        else _Gather.apply(x, shard, size, rank, world, group, where)
    )


def gather_reduce_backward(x, dim, chunks, units, of, groups, size, rank, world, group, where):
    shard = Shard(dim, chunks, units, of, groups)
    return (
        gather_values(x, shard, size, world, group, where)
        if _no_grad()
        else _GatherReduceBackward.apply(x, shard, size, rank, world, group, where)
    )


def gather_tokens(x, dim, chunks, units, of, groups, size, rank, world, group, where, reduce_backward):
    """A gather along a token dim (sequence parallelism): an op that saves the result for its backward
    keeps this rank's tokens instead.  Eager: saved-tensor hooks (autotp.runtime.activations); compiled: the
    gather is marked must-recompute, as SimpleFSDP marks its parameter gathers, so the partitioner keeps the
    piece and gathers again in the backward (one graph, no hooks)."""
    collective = gather_reduce_backward if reduce_backward else gather

    def gathered(piece: torch.Tensor) -> torch.Tensor:
        return collective(piece, dim, chunks, units, of, groups, size, rank, world, group, where)

    if _no_grad():
        return gathered(x)
    if torch.compiler.is_compiling():
        return checkpoint(gathered, x, use_reentrant=False, context_fn=_recomputed)
    full = gathered(x)
    shard = Shard(dim, chunks, units, of, groups)
    return activations.remember(full, x, lambda piece: start_gather(piece, shard, size, world, group, where))


def _recomputed():
    """Selective-checkpoint contexts that recompute every op of the region (a token gather) in the backward."""
    return create_selective_checkpoint_contexts(lambda ctx, op, *args, **kwargs: CheckpointPolicy.MUST_RECOMPUTE)


def scatter(x, dim, chunks, units, of, groups, size, rank, world, group, where):
    shard = Shard(dim, chunks, units, of, groups)
    if _no_grad():
        return take_local(x, shard, rank, world)
    return _Scatter.apply(x, shard, size, rank, world, group, where)


def sum_group_grads(xs, layouts, rank, world, group, where):
    """``layouts``: (dim, chunks, units, of, groups, full size) per tensor of ``xs``; one all-reduce for all."""
    if _no_grad():
        return tuple(xs)
    return _SumGroupGrads.apply([(Shard(*layout[:5]), layout[5]) for layout in layouts], rank, world, group, where, *xs)


def shard_args(shard: Shard, size: int, rank: int, world: int, group: str, where: str) -> tuple:
    return (shard.dim, shard.chunks, shard.units, shard.of, shard.groups, size, rank, world, group, where)


def conversion_steps(
    src,
    dst,
    shape,
    rank: int,
    world: int,
    group: str,
    partial_grad: bool = False,
    where: str = "",
    regather: bool = True,
) -> list[tuple]:
    """The runtime calls (function, arguments after the tensor) that turn ``src`` into ``dst`` for a
    tensor of full ``shape``.  ``partial_grad``: the result feeds a sharded op as a replicated input,
    so its gradient comes back as partial sums that must be added up.  ``where``: the value, for errors.
    ``regather``: a gather along tokens keeps this rank's piece for the backward (gather_tokens), else the
    gathered tensor is saved as any other."""

    def args(shard: Shard) -> tuple:  # a size known only at run time (a token dim) is a graph node
        size = shape[shard.dim]
        return shard_args(shard, size if isinstance(size, Node) else int(size), rank, world, group, where)

    if isinstance(src, Routed) or isinstance(dst, Routed):
        return []  # an expert segment's entry and exit: its dispatch moves the rows (runtime/expert_dispatch.py)
    if regather and isinstance(src, Shard) and isinstance(dst, Replicate) and isinstance(shape[src.dim], Node):
        return [(gather_tokens, (*args(src), partial_grad))]
    if partial_grad and isinstance(src, Shard) and isinstance(dst, Replicate):
        return [(gather_reduce_backward, args(src))]
    steps: list[tuple] = []
    if src == dst or (isinstance(src, Partial) and type(dst) is Partial):  # a disjoint partial is a partial sum
        return [(reduce_grad, (group, where))] if partial_grad else steps
    if isinstance(src, Partial) and isinstance(dst, Shard):
        return [(reduce_scatter, args(dst))]
    if isinstance(src, Partial):
        steps.append((all_reduce, (group, where)))
    elif isinstance(src, Shard):
        steps.append((gather, args(src)))
    if isinstance(dst, Shard):
        steps.append((scatter, args(dst)))
    elif not isinstance(dst, Replicate):
        raise ValueError(f"cannot convert {src} to {dst}")
    return steps + ([(reduce_grad, (group, where))] if partial_grad else [])


def gather_full(x: torch.Tensor, placement, size: int | None, group) -> torch.Tensor:
    """The full tensor from this rank's piece (no autograd), for checkpoints and tests."""
    if isinstance(placement, Shard):
        world = torch.distributed.get_world_size(group)
        return gather_values(x.detach(), placement, size, world, group.group_name, "a full tensor (checkpoint)")
    return x.detach().clone()
