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

import weakref

import torch
from torch.utils.checkpoint import checkpoint

_PIECES: dict = {}  # storage address of a live gathered tensor -> [piece, gather, saves not yet unpacked, gathered]


def remember(full: torch.Tensor, piece: torch.Tensor, gather) -> torch.Tensor:
    """Mark ``full`` (all-gathered from ``piece``) as rebuildable by ``gather(piece)``.  The entry lives as
    long as ``full``, so its storage address cannot be reused by another tensor meanwhile."""
    key = full.untyped_storage().data_ptr()
    _PIECES[key] = [piece.detach(), gather, 0, None]
    weakref.finalize(full, _PIECES.pop, key, None)
    return full


def _pack(tensor: torch.Tensor):
    entry = _PIECES.get(tensor.untyped_storage().data_ptr())
    if entry is None:
        return tensor
    entry[2] += 1
    return entry, tensor.size(), tensor.stride(), tensor.storage_offset()


def _unpack(packed):
    """The saved tensor; a gathered one is gathered once more for all the ops that saved it (q, k and v
    projections share their input), and dropped when the last of them has unpacked it."""
    if isinstance(packed, torch.Tensor):
        return packed
    entry, size, stride, offset = packed
    if entry[3] is None:
        with torch.no_grad():
            entry[3] = entry[1](entry[0])  # contiguous, laid out as the first gather's result
    full = entry[3]
    entry[2] -= 1
    if entry[2] <= 0:
        entry[3] = None
    return full.as_strided(size, stride, offset)


def keep_pieces(module: torch.nn.Module) -> None:
    """Run ``module``'s forwards under the hooks (left again even when the forward raises)."""
    entered: list = []

    def enter(mod, args):
        if torch.compiler.is_compiling():  # compiled: gathers are marked for recompute instead (gather_tokens)
            return
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
