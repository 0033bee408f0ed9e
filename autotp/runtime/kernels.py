"""Local forms of ops whose sharded version is not the same op on smaller tensors.

The rewriter (passes/rewrite.py) calls these with this rank's offsets baked in.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def repeat_heads(x: torch.Tensor, repeats: int, dim: int, in_start: int, out_start: int, out_len: int):
    """This rank's heads [out_start, out_start + out_len) of x.repeat_interleave(repeats, dim), from its
    KV heads starting at ``in_start`` (all of them when x is replicated)."""
    first = out_start // repeats - in_start
    last = (out_start + out_len - 1) // repeats - in_start
    needed = x.narrow(dim, first, last - first + 1).repeat_interleave(repeats, dim)
    return needed.narrow(dim, out_start - (first + in_start) * repeats, out_len)


def repeat_range(x: torch.Tensor, sizes, dim: int, start: int, length: int):
    """This rank's [start, start + length) of ``x.repeat(sizes)`` along ``dim`` (x whole on every rank)."""
    return x.repeat(sizes).narrow(dim, start, length)


def gather_positions(x: torch.Tensor, dim: int, positions: tuple[int, ...]):
    """``x.index_select(dim, positions)`` with this rank's positions in its own piece (a gather of heads whose
    pieces several ranks hold: canonicalize/group_cuts.py)."""
    return x.index_select(dim, torch.tensor(positions, device=x.device))


def _held_rows(ids: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which ids this rank holds (rows [start, start + rows)), and the local row of each (0 for the others)."""
    mine = (ids >= start) & (ids < start + rows)
    return mine, torch.where(mine, ids - start, torch.zeros_like(ids))


def vocab_embedding(weight: torch.Tensor, ids: torch.Tensor, start: int, padding_idx: int = -1):
    """Megatron's vocab-parallel lookup: rows [start, start + len) live here, other ids give zeros
    (the partial sums are all-reduced afterwards).  Zeros by masking, not by multiplying: the row
    looked up in their place may hold an Inf or NaN, and 0 x Inf would leak it into the sum."""
    rows = weight.shape[0]
    mine, local = _held_rows(ids, start, rows)
    pad = padding_idx - start if 0 <= padding_idx - start < rows else -1
    return aten.embedding.default(weight, local, pad).masked_fill(~mine.unsqueeze(-1), 0)


def expert_rows(weight: torch.Tensor, ids: torch.Tensor, start: int) -> torch.Tensor:
    """``w[ids]`` with only experts [start, start + len) here: their matrices, zeros for other experts'
    tokens (masked, as vocab_embedding does), so the products computed from them are disjoint partial sums."""
    mine, local = _held_rows(ids, start, weight.shape[0])
    return weight[local].masked_fill(~mine.view(*mine.shape, *[1] * (weight.dim() - 1)), 0)


class _Rows(torch.autograd.Function):
    """``x.index_select(0, index)`` for a permutation ``index`` whose inverse is ``back``: the gradient is
    gathered back the same way (no scatter-add, as the gradient of a general gather needs)."""

    @staticmethod
    def forward(ctx, x, index, back):
        ctx.save_for_backward(back, index)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        back, index = ctx.saved_tensors
        return _Rows.apply(grad, back, index), None, None


def expert_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, first: int, fallback: bool):
    """A grouped matmul (tokens sorted by expert, ``offs`` their cumulative counts) with only experts
    [first, first + len(weight)) here: their rows of x go through them, the other rows are zeros.

    Eager, one host read of the offsets slices this rank's rows (a view) and pads the result with zeros.
    Compiled, a read would give the grouped product unbacked sizes, which inductor cannot lower for transformers'
    fallback op: the rows are rotated instead by their start, an offset held on the device, so that this rank's
    come first, and the grouped product runs on those rows only, with offsets of its own experts.  The other
    rows are masked (not multiplied: the grouped product leaves rows past its last offset unwritten) before and
    after, so neither the result nor the gradient of x reads them; the rotations and masks move every row (all
    rows' memory traffic, measured 10-40% slower than the eager form on the CPU), the product only this rank's."""
    grouped = torch.ops.transformers.grouped_mm_fallback if fallback else aten._grouped_mm
    if not torch.compiler.is_compiling():
        ends = offs.tolist()
        start, end = (ends[first - 1] if first else 0), ends[first + weight.shape[0] - 1]
        mine = grouped(x[start:end], weight, offs[first : first + weight.shape[0]] - start)
        return torch.cat([mine.new_zeros(start, mine.shape[1]), mine, mine.new_zeros(x.shape[0] - end, mine.shape[1])])
    rows = max(x.shape[0], 1)
    begin = offs[first - 1] if first else offs.new_zeros(())
    local = offs[first : first + weight.shape[0]] - begin
    at = torch.arange(x.shape[0], device=x.device)
    held = (at < local[-1]).unsqueeze(-1)  # rotated rows of this rank's experts
    ahead, back = (at + begin) % rows, (at - begin) % rows
    out = grouped(torch.where(held, _Rows.apply(x, ahead, back), 0), weight, local)
    return _Rows.apply(torch.where(held, out, 0), back, ahead)


def partial_mean(x: torch.Tensor, dims, keepdim: bool = False, count: int = 1, *, dtype=None):
    """This rank's share of a mean over a sharded dim: its sum divided by the full count."""
    return x.sum(dims, keepdim=keepdim, dtype=dtype) / count


class _AddedByRank0(torch.autograd.Function):
    """Zeros in place of a replicated operand of a partial sum that rank 0 adds; its gradient passes
    through unchanged, so every rank holds the whole gradient of the operand, as for any replicated value."""

    @staticmethod
    def forward(ctx, x):
        return x.new_zeros(()).expand(x.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad


def added_by_rank0(x: torch.Tensor) -> torch.Tensor:
    return _AddedByRank0.apply(x) if torch.is_grad_enabled() else x.new_zeros(()).expand(x.shape)


def histc_of_integers(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    """``histc`` of integer values on the CPU, which has no integer kernel: a graph captured on the meta
    device takes the GPU branch of code that picks the dtype by device (transformers' grouped experts).
    The same counts from the values as floats (exact below 2**24), in the captured dtype."""
    return torch.histc(x.float(), bins, min, max).to(x.dtype)
