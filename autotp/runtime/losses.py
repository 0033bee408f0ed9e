"""Cross-entropy on vocab-sharded logits (Megatron's vocab_parallel_cross_entropy).

With ``parallelize(..., gather_outputs=False)`` a vocab-parallel LM head leaves each rank its
slice of the logits; this loss needs only three all-reduces of (tokens,) vectors, so no rank ever
holds the full [tokens, vocab] logits.  The slices follow autotp's layout for a vocabulary of V:
rank r holds columns ``Shard(-1, units=V).ranges(V, r, N)`` (equal slices when N divides V).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autotp.placement import Shard

_c10d = torch.ops._c10d_functional


def _reduce(x: torch.Tensor, op: str, group: str) -> torch.Tensor:
    return _c10d.wait_tensor(_c10d.all_reduce(x.contiguous(), op, group))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, start, group, ignore_index):
        rows = logits.shape[-1]
        ctx.dtype = logits.dtype
        logits = logits.float()
        peak = _reduce(logits.max(dim=-1).values, "max", group)
        shifted = logits - peak.unsqueeze(-1)
        mine = (labels >= start) & (labels < start + rows)
        local = torch.where(mine, labels - start, torch.zeros_like(labels))
        target = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine
        exp = shifted.exp()
        total = _reduce(exp.sum(dim=-1), "sum", group)
        target = _reduce(target, "sum", group)
        keep = labels != ignore_index
        count = keep.sum().clamp(min=1)
        loss = ((total.log() - target) * keep).sum() / count
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, mine & keep, keep, count)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local, hit, keep, count = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1).to(g.dtype))
        g = g * (keep.unsqueeze(-1) * grad / count)
        return g.to(ctx.dtype), None, None, None, None


def parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, group=None, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy over tokens whose label is not ``ignore_index``, equal to
    ``F.cross_entropy(full_logits.flatten(0, -2), labels.flatten())``.  A collective over ``group``.

    ``logits``: this rank's [..., V_local] slice; full logits (V_local == vocab_size) work too.
    """
    group = group or dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ((start, length),) = Shard(-1, units=vocab_size).ranges(vocab_size, rank, world)
    if logits.shape[-1] == vocab_size:
        start, group_name = 0, None
    elif logits.shape[-1] == length:
        group_name = group.group_name
    else:
        raise ValueError(
            f"logits have {logits.shape[-1]} columns on rank {rank}: expected this rank's vocabulary "
            f"slice ({length} of {vocab_size}) or the full vocabulary; pass the logits of a model "
            "sharded with gather_outputs=False, and vocab_size=config.vocab_size"
        )
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels of shape {tuple(labels.shape)} do not match logits {tuple(logits.shape)} "
            "(one label per row of logits)"
        )
    if group_name is None:
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, -2).float(), labels.flatten(), ignore_index=ignore_index
        )
    return _VocabParallelCrossEntropy.apply(logits.flatten(0, -2), labels.flatten(), start, group_name, ignore_index)
