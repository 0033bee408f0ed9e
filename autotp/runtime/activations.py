"""What the sharded program keeps for its backward, at run time.

Recomputed regions: a piece of the program whose backward computes it again instead of keeping what its ops
save (torch.utils.checkpoint, non-reentrant: its inputs are kept, its RNG state restored for dropout).

Token pieces: sequence parallelism keeps tokens, not gathered copies, for the backward (Megatron-SP; Korthikanti
et al. 2022 §4.2.2): when an op saves a tensor all-gathered along the tokens (a column-parallel
matmul's input), autograd stores this rank's piece instead and gathers it again when the backward
unpacks it.  The saving is made through saved-tensor hooks that the sharded program enters for its
forward; a tensor that was not gathered along the tokens is saved as usual.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch.utils.checkpoint import checkpoint


class _Kept:
    """A gathered tensor kept as this rank's piece: how to gather it again, and that gather's state."""

    __slots__ = ("__weakref__", "forward", "full", "order", "pending", "piece", "saves", "start")

    def __init__(self, piece: torch.Tensor, start, order: int, forward: int):
        self.piece, self.start, self.order, self.forward = piece, start, order, forward
        self.saves = 0  # saves not yet unpacked
        self.full = None  # gathered again, for the saves still to unpack
        self.pending = None  # a gather issued ahead of its unpack: waits for it


_PIECES: dict = {}  # storage address of a live gathered tensor -> its _Kept
_KEPT: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # forward order -> _Kept some backward holds
_count = itertools.count()
_forwards = [0]  # the sharded forward running now (keep_pieces counts them): prefetches stay within one


def remember(full: torch.Tensor, piece: torch.Tensor, start) -> torch.Tensor:
    """Mark ``full`` (all-gathered from ``piece``) as rebuildable by ``start(piece)()`` (``start`` issues the
    gather, what it returns waits for it).  The entry lives as long as ``full``, so its storage address cannot be
    reused by another tensor meanwhile; the backward holds it as long as it holds the saves."""
    key = full.untyped_storage().data_ptr()
    kept = _Kept(piece.detach(), start, next(_count), _forwards[0])
    _PIECES[key] = _KEPT[kept.order] = kept
    weakref.finalize(full, _PIECES.pop, key, None)
    return full


def _pack(tensor: torch.Tensor):
    kept = _PIECES.get(tensor.untyped_storage().data_ptr())
    if kept is None:
        return tensor
    kept.saves += 1
    return kept, tensor.size(), tensor.stride(), tensor.storage_offset()


def _unpack(packed):
    """The saved tensor; a gathered one is gathered once more for all the ops that saved it (q, k and v
    projections share their input), and dropped when the last of them has unpacked it.  Its gather is waited
    for here; the gather of the tensor kept before it in the forward is issued next, so the backward's compute
    until that one is unpacked runs while it travels (FSDP's backward prefetch, one ahead)."""
    if isinstance(packed, torch.Tensor):
        return packed
    kept, size, stride, offset = packed
    if kept.full is None:
        with torch.no_grad():
            kept.full = (kept.pending or kept.start(kept.piece))()  # contiguous, laid out as the first gather's
            kept.pending = None
            _prefetch_before(kept)
    full = kept.full
    kept.saves -= 1
    if kept.saves <= 0:
        kept.full = None
    return full.as_strided(size, stride, offset)


def _prefetch_before(kept: _Kept) -> None:
    """Issue the gather of the tensor kept before ``kept`` in the same forward, if it still waits for its unpack."""
    earlier = [k for order, k in list(_KEPT.items()) if order < kept.order and k.forward == kept.forward]
    ahead = max(earlier, key=lambda k: k.order, default=None)
    if ahead is not None and ahead.saves > 0 and ahead.full is None and ahead.pending is None:
        ahead.pending = ahead.start(ahead.piece)


def keep_pieces(module: torch.nn.Module) -> None:
    """Run ``module``'s forwards under the hooks (left again even when the forward raises)."""
    entered: list = []

    def enter(mod, args):
        if torch.compiler.is_compiling():  # compiled: gathers are marked for recompute instead (gather_tokens)
            return
        _forwards[0] += 1
        hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        hooks.__enter__()
        entered.append(hooks)

    def leave(mod, args, out):
        if torch.compiler.is_compiling():
            return
        entered.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


class Recomputed(torch.nn.Module):
    def __init__(self, region: torch.nn.Module):
        super().__init__()
        self.region = region

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return self.region(*args)
        # its forward, not the module: module hooks (CommDebugMode's tracker) must not see it run in backward
        return checkpoint(self.region.forward, *args, use_reentrant=False)
