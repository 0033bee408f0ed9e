"""Is the captured program the model?  torch.export traces the model's Python once, and a library may take another
branch while traced (transformers builds attention masks differently under torch.export, for one).  autotp shards
the traced program, so a program that computes other values than the model run eagerly would be sharded exactly --
and wrong.  One eager and one traced forward on the example inputs find it before any plan is made."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves, tree_map

from autotp.ops.table import drops, op


class UnfaithfulCapture(RuntimeError):
    """The captured program and the eager model compute other values on the example inputs."""


def float_leaves(out) -> list[torch.Tensor]:
    """A model output's floating-point tensors, in order (the coverage sweep compares them too)."""
    if hasattr(out, "to_tuple"):  # transformers' ModelOutput: the fields that are set, in order
        out = out.to_tuple()
    return [x for x in tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()]


def _checkable(model: torch.nn.Module, program: torch.export.ExportedProgram, args, kwargs) -> bool:
    """Only where the two forwards can be compared: real tensors, no random op (dropout in training mode draws
    other masks in each)."""
    tensors = [
        *model.parameters(),
        *model.buffers(),
        *(x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)),
    ]
    if any(t.is_meta or type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return False
    return not any(_random(node) for node in program.graph.nodes)


def _random(node: torch.fx.Node) -> bool:
    """Draws random numbers: a dropout the op table says draws (attention with dropout_p > 0), or an op torch
    tags as seeded that the table has no rule for."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if op(node.target).drops is not None:
        return drops(node)
    return torch.Tag.nondeterministic_seeded in node.target.tags


def _untouched(model: torch.nn.Module, args, kwargs, forward) -> list[torch.Tensor]:
    """``forward``'s outputs on copies of the inputs, the model's buffers as they were before and after (a forward
    in training mode moves BatchNorm's statistics, a cache fills): the check leaves no trace, nor one run on the
    other."""
    kept = [(b, b.clone()) for b in model.buffers()]
    copies = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (args, kwargs))
    try:
        with torch.no_grad():
            return float_leaves(forward(*copies[0], **copies[1]))
    finally:
        with torch.no_grad():
            for buffer, value in kept:
                buffer.copy_(value)


def _tolerance(value: torch.Tensor) -> float:
    """Both run the same ATen ops; a few roundings of the value's dtype apart at most."""
    return max(1e-3, 16 * torch.finfo(value.dtype).eps)


def check_faithful(
    model: torch.nn.Module, program: torch.export.ExportedProgram, gm: torch.fx.GraphModule, args: tuple, kwargs: dict
) -> None:
    if not _checkable(model, program, args, kwargs):
        return
    want, got = _untouched(model, args, kwargs, model), _untouched(model, args, kwargs, gm)
    if len(want) != len(got):
        return  # outputs that do not pair up (a cache object flattened otherwise): nothing to compare
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        if w.shape != g.shape:
            raise UnfaithfulCapture(_message(model, i, f"shape {tuple(g.shape)}, eagerly {tuple(w.shape)}"))
        scale = w.abs().max().item() if w.numel() else 0.0
        error = (g.float() - w.float()).abs().max().item() if w.numel() else 0.0
        if not error <= _tolerance(w) * max(scale, 1.0):  # NaN where the other is finite counts too
            raise UnfaithfulCapture(_message(model, i, f"max error {error:.3g} against values up to {scale:.3g}"))


def _message(model: torch.nn.Module, output: int, detail: str) -> str:
    return (
        f"torch.export's program of {type(model).__name__} is not the model: on the example inputs its output "
        f"{output} differs from the model run eagerly ({detail}), so the model's code takes another branch while "
        "traced; autotp would shard the traced program, so it stops: pass inputs that make both take the same "
        "branch (e.g. an explicit attention_mask), or report it to the model's library"
    )
