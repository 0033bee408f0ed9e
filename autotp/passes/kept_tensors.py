"""What autograd keeps for backward, op by op: the activation memory of a plan.

Each op's backward formula (PyTorch's derivatives.yaml) needs some of its inputs, its output, or
tensors of its own: a matmul keeps the operand the other one's gradient is multiplied by, GELU its
input, softmax its output, dropout a one-byte mask (CUDA's ``native_dropout``), layer norm its input
and per-row mean and 1/std in fp32: the op table's ``keeps`` (ops/table.py).  A kept tensor is counted
once, at the storage it views (a matmul's transposed K and the Q beside it are both pieces of one projection
output), in the placement its reader holds it in.  Inputs, parameters and buffers are not activations.  An op
the table does not know is assumed to keep all its tensor inputs (never less than it does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.fx import Node

from autotp.ops.strategies import input_slots, is_placed, on_tokens
from autotp.ops.table import op
from autotp.placement import R


@dataclass(frozen=True)
class Kept:
    """One tensor kept for backward: ``tensor``'s storage in ``placement``, or an op's own tensor
    (``kind`` "mask": one byte per element of ``tensor``; "stats": two fp32 numbers per normalized row;
    "additive": an attention mask, which SDPA's kernels keep as a bias of the query's dtype)."""

    tensor: Node
    placement: object
    kind: str = "value"
    like: Node | None = None  # kind "additive": a mask kept as an additive bias in this node's dtype


def storage(node: Node) -> Node:
    """The node whose output ``node`` is a view of (itself if it is no view; an output of a multi-output
    op that is no view, such as ``topk``, is its own storage)."""
    while node.op == "call_function" and op(node.target).view and isinstance(node.args[0], Node):
        parent = node.args[0]
        if not op(parent.target).view and not isinstance(parent.meta.get("val"), torch.Tensor):
            break
        node = parent
    return node


def kept(node: Node, strategy, grad: set) -> list[Kept]:
    """The activations ``node``'s backward keeps under ``strategy`` (none if no gradient flows through it)."""
    if node.op != "call_function" or node not in grad:
        return []
    slots = input_slots(node)
    keeps = op(node.target).keeps
    found = []
    for slot, kind in keeps(node, grad) if keeps else [(i, None) for i, s in enumerate(slots) if is_placed(s)]:
        if slot is None:
            found.append(Kept(node, strategy.output, kind or "value"))
            continue
        src = slots[slot]
        base = storage(src)
        # inputs, parameters and buffers are counted apart; a list of tensors (an unknown op's) is not counted
        if isinstance(base.meta.get("val"), torch.Tensor) and base.op == "call_function":
            found.append(Kept(base, strategy.inputs[slot], kind or "value", node if kind else None))
    return found


def element_bytes(item: Kept, numel: float) -> float:
    """Bytes of a kept tensor whose full ``item.tensor`` has ``numel`` elements (before sharding)."""
    val = item.tensor.meta["val"]
    if item.kind == "mask":
        return float(numel)
    if item.kind == "additive":
        return numel * item.like.meta["val"].element_size()
    if item.kind == "stats":
        if op(item.tensor.target).family == "layer_norm":
            rows = numel / math.prod(item.tensor.args[1])
            return 2 * 4 * rows
        return 4 * numel / val.shape[-1]  # attention: one fp32 log-sum-exp per query row
    return numel * val.element_size()


def kept_whole(choice: dict, grad: set) -> dict:
    """tensor -> the ops that keep it whole (gathered) for their backward."""
    found: dict = {}
    for node, strategy in choice.items():
        for item in kept(node, strategy, grad):
            if item.kind == "value" and item.placement == R:
                found.setdefault(item.tensor, set()).add(node)
    return found


def kept_gathered(choice: dict, grad: set) -> set:
    """Token-split tensors that some op keeps gathered for its backward: each is kept whole, or as this rank's
    piece gathered again in the backward (autotp.runtime.activations), as the plan chose (its regathers)."""
    return {tensor for tensor in kept_whole(choice, grad) if tensor in choice and on_tokens(tensor, choice[tensor])}
