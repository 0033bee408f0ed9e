"""Expert parallelism by all-to-all: an expert segment (ops/expert_segments.py) run by the owners of the experts.

Every rank of the dispatch group holds its own routed slots (rows sorted by expert id, or with their ids).  It
tells every rank how many of its rows go to each of that rank's experts (one all-to-all of E integers, uneven
splits when the experts do not divide the ranks), sends the rows (all-to-all, uneven splits), and each owner runs
the segment's own ops on the rows it received, grouped by its local experts (a grouped matmul on exactly those
rows: no row of another rank's expert, no zeros).  The results travel back by the reverse all-to-all.  Dropless:
every routed row is computed, whatever the load.  Ranks that hold the same rows (a TP group inside the dispatch
group, the "copies") each send the routed rows of a contiguous share of the slots and all-gather the results.
The sizes reach the host once a layer, the splits of both directions in one read: a compiled program holds them
as unbacked sizes, checked as such, and nothing else in the dispatch depends on values.

The backward is the same exchange with the splits swapped: every token's contribution reaches the owner of its
expert, so expert gradients are complete on their owner and need no sum inside the group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autotp.placement import Shard, take_local
from autotp.runtime import collectives, transport


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, where):
        ctx.args = (in_splits, out_splits, group, where)
        return transport.exchange(x, out_splits, in_splits, group, where)

    @staticmethod
    def backward(ctx, grad):
        return transport.exchange(grad, *ctx.args), None, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list, in_splits: list, group: str, where: str) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return transport.exchange(x, out_splits, in_splits, group, where)
    return _AllToAll.apply(x, out_splits, in_splits, group, where)


def _lengths(rows: int, ranks: int) -> list:
    """Contiguous shares of ``rows`` over ``ranks``, the first ones one more; none for some when rows are few."""
    base, extra = divmod(rows, ranks)
    return [base + (r < extra) for r in range(ranks)]


class _Share(torch.autograd.Function):
    """This copy's share of rows every copy holds; the gradient of the whole is every copy's share of it."""

    @staticmethod
    def forward(ctx, x, lengths, copies, where):
        ctx.args = (lengths, copies.name, where)
        return x.narrow(0, sum(lengths[: copies.rank]), lengths[copies.rank])

    @staticmethod
    def backward(ctx, grad):
        return transport.gather_rows(grad, *ctx.args), None, None, None


class _Gather(torch.autograd.Function):
    """Every copy's share of rows, put together; the gradient (the same on every copy) is cut to this share."""

    @staticmethod
    def forward(ctx, x, lengths, copies, where):
        ctx.start, ctx.length = sum(lengths[: copies.rank]), lengths[copies.rank]
        return transport.gather_rows(x, lengths, copies.name, where)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(0, ctx.start, ctx.length), None, None, None


@dataclass(frozen=True)
class Group:
    """A process group by name, with this rank's place in it."""

    name: str
    rank: int
    size: int


@dataclass(frozen=True)
class Groups:
    """Where expert segments are dispatched: ``routed``, the ranks a segment the plan routes (``A`` placements)
    deals its experts over: the TP group, or a mesh's "ep" x "tp" ranks; ``ep``, a mesh's "ep" ranks (None
    without one), over which every other segment is dispatched, split over TP as the plan says."""

    routed: Group
    ep: Group | None = None


@dataclass(frozen=True)
class Dealt:
    """An expert table's experts dealt over a dispatch group (``experts``: a Shard of its dim 0, ``count``
    experts): each rank holds its own whole experts, split further only as the TP plan says."""

    experts: Shard
    count: int
    group: Group

    def spans(self, rows: int) -> list:
        """The (start, length) row spans of this rank's experts in a full table of ``rows`` rows."""
        return self.experts.ranges(rows, self.group.rank, self.group.size)

    def shape(self, full) -> list:
        """The shape of this rank's experts of a full table of shape ``full``."""
        return [sum(n for _, n in self.spans(full[0])), *full[1:]]

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's experts of the full table."""
        return take_local(full, self.experts, self.group.rank, self.group.size)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The full table from every rank's experts (a collective over the group, no autograd)."""
        return collectives.gather_values(
            local.detach(), self.experts, self.count, self.group.size, self.group.name, "an expert table (checkpoint)"
        )


@dataclass
class _Routes:
    send: list  # rows this rank sends to each rank of the group
    recv: list  # rows it receives from each
    order: torch.Tensor  # received rows (by source rank, then local expert) -> by local expert, then source
    counts: torch.Tensor  # rows received per local expert


def _routes(counts: torch.Tensor, owners: list, group: Group, where: str) -> _Routes:
    """``counts``: this rank's rows per expert (int64, E).  One all-to-all of the counts gives the
    [group size, local experts] matrix of rows this rank will receive; the layer's one host read gives the
    splits, rows sent to and received from each rank together (a compiled graph holds them as unbacked sizes:
    dynamo's ``capture_scalar_outputs``, which ExpertDispatch turns on)."""
    mine = owners[group.rank][1]
    matrix = transport.exchange(
        counts, [mine] * group.size, [n for _, n in owners], group.name, f"the row counts of {where}"
    ).view(group.size, mine)
    owner = torch.tensor([r for r, (_, n) in enumerate(owners) for _ in range(n)], device=counts.device)
    sends = counts.new_zeros(group.size).index_add_(0, owner, counts)
    splits = torch.cat([sends, matrix.sum(1)]).cpu().tolist()  # the one host read (one copy, whatever the device)
    for n in splits:
        torch._check_is_size(n)
    send, recv = splits[: group.size], splits[group.size :]
    received = sum(recv)
    local = torch.arange(mine, device=counts.device).repeat(group.size)
    local = local.repeat_interleave(matrix.flatten(), output_size=received)
    return _Routes(send, recv, torch.argsort(local, stable=True), matrix.sum(0))


def _inverse(order: torch.Tensor) -> torch.Tensor:
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return back


def _share(ends: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows per expert among sorted rows [start, stop), from each expert's cumulative end."""
    begins = torch.cat([ends.new_zeros(1), ends[:-1]])
    return (ends.clamp(start, stop) - begins.clamp(start, stop)).clamp_min(0)


class ExpertDispatch(torch.nn.Module):
    """Runs ``segment`` (a GraphModule: row inputs, then the local key, then tables and other inputs) on the
    owners of the experts.  ``grouped``: the key is a grouped matmul's offsets (rows sorted by expert), else
    each row's expert id (rows in any order; sorted here and put back after).  The key handed to the segment
    is the owner's: offsets of its local experts over the rows it received, or each received row's local id."""

    def __init__(
        self,
        segment: torch.fx.GraphModule,
        *,
        experts: int,
        grouped: bool,
        rows: int,
        outputs: int,
        owners: list,
        group: Group,
        copies: Group | None,
        where: str,
    ):
        super().__init__()
        self.segment = segment
        self.experts, self.grouped, self.rows, self.outputs = experts, grouped, rows, outputs
        self.owners, self.group, self.copies, self.where = owners, group, copies, where
        self.received = 0  # rows the segment last ran on (eager): only those of this rank's experts
        torch._dynamo.config.capture_scalar_outputs = True  # compiled, the splits are sizes in the graph (_routes)

    def forward(self, key, *args):
        rows, rest = list(args[: self.rows]), args[self.rows :]
        slots = rows[0].shape[0]
        if self.grouped:  # grouped rows past the last offset belong to no expert
            ends, order = key.to(torch.int64), None
        else:
            order = torch.argsort(key, stable=True)
            per_expert = key.new_zeros(self.experts, dtype=torch.int64).index_add_(0, key, torch.ones_like(key))
            ends = torch.cumsum(per_expert, 0)
            rows = [r[order] for r in rows]
        start, length, shares = 0, slots, None
        if self.copies is not None:  # each copy sends the routed rows of its share of the slots
            shares = _lengths(slots, self.copies.size)
            start, length = sum(shares[: self.copies.rank]), shares[self.copies.rank]
            rows = [
                _Share.apply(r, shares, self.copies, self.where)
                if torch.is_grad_enabled()
                else r.narrow(0, start, length)
                for r in rows
            ]
        routes = _routes(_share(ends, start, start + length), self.owners, self.group, self.where)
        routed = sum(routes.send)  # the share's first rows: those past the last offset are sent nowhere
        torch._check(routed <= length)
        sent = [
            all_to_all(r[:routed], routes.recv, routes.send, self.group.name, self.where)[routes.order] for r in rows
        ]
        offsets = torch.cumsum(routes.counts, 0)
        local = (
            offsets.to(key.dtype)
            if self.grouped
            else torch.arange(routes.counts.numel(), device=key.device).repeat_interleave(
                routes.counts, output_size=sent[0].shape[0]
            )
        )
        if not torch.compiler.is_compiling():
            self.received = sent[0].shape[0]
        out = self.segment(*sent, local, *rest)
        outs = out if self.outputs > 1 else (out,)
        back = _inverse(routes.order)
        found = []
        for y in outs:
            y = transport.pad(all_to_all(y[back], routes.send, routes.recv, self.group.name, self.where), length)
            if shares is not None:
                y = (
                    _Gather.apply(y, shares, self.copies, self.where)
                    if torch.is_grad_enabled()
                    else transport.gather_rows(y, shares, self.copies.name, self.where)
                )
            if order is not None:
                y = torch.empty_like(y).index_copy(0, order, y)
            found.append(y)
        return tuple(found) if self.outputs > 1 else found[0]
