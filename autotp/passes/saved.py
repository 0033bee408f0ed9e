"""What autograd keeps for backward, op by op: the activation memory of a plan.

Each op's backward formula (PyTorch's derivatives.yaml) needs some of its inputs, its output, or
tensors of its own: a matmul keeps the operand the other one's gradient is multiplied by, GELU its
input, softmax its output, dropout a one-byte mask (CUDA's ``native_dropout``), layer norm its input
and per-row mean and 1/std in fp32.  A kept tensor is counted once, at the storage it views (a
matmul's transposed K and the Q beside it are both pieces of one projection output), in the
placement its reader holds it in.  Inputs, parameters and buffers are not activations.  An op this
table does not know is assumed to keep all its tensor inputs (never less than it does).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
from torch.fx import Node

from autotp.runtime.placement import R

from .strategies import input_slots, is_placed

aten = torch.ops.aten

# outputs that alias their input: what they keep is their input's storage
VIEWS = {getattr(aten, name).default for name in
         ("view", "reshape", "_unsafe_view", "permute", "t", "expand", "unsqueeze", "alias", "detach",
          "split_with_sizes", "chunk")} | {
    aten.transpose.int, aten.slice.Tensor, aten.select.int, aten.split.Tensor, aten.unbind.int, aten.squeeze.dim,
    aten.squeeze.dims, operator.getitem}


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
    while node.op == "call_function" and node.target in VIEWS and isinstance(node.args[0], Node):
        parent = node.args[0]
        if parent.target not in VIEWS and not isinstance(parent.meta.get("val"), torch.Tensor):
            break
        node = parent
    return node


def _nothing(node, strategy, grad):
    return []


def _inputs(*slots):
    def keep(node, strategy, grad):
        return [(i, None) for i in slots]
    return keep


def _output(node, strategy, grad):
    return [(None, None)]


def _product(node, strategy, grad):
    """a * b or a @ b: a's gradient needs b and b's needs a."""
    a, b = node.args[0], node.args[1]
    if not (isinstance(a, Node) and isinstance(b, Node)):
        return []  # scaled by a number: nothing kept
    return [(1, None)] * (a in grad) + [(0, None)] * (b in grad)


def _divide(node, strategy, grad):
    a, b = node.args[0], node.args[1]
    if not isinstance(b, Node):
        return []
    return [(1, None)] + [(0, None)] * (b in grad and isinstance(a, Node))


def _dropout(node, strategy, grad):
    p, train = node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return [(None, "mask")] if train and 0 < p < 1 else []  # eval mode and p = 0 return the input itself


def _layer_norm(node, strategy, grad):
    return [(0, None), (None, "stats")]


def _attention(node, strategy, grad):
    """SDPA's fused kernels keep q, k, v, the mask, the output and the log-sum-exp of each row (fp32)."""
    mask = sum(isinstance(a, Node) for a in node.args[3:4]) + isinstance(node.kwargs.get("attn_mask"), Node)
    return [(0, None), (1, None), (2, None), *((3, "additive") for _ in range(mask)), (None, None), (None, "stats")]


def _condition(node, strategy, grad):
    return [(0, None)]  # where / masked_fill: the boolean condition


_TABLE = {
    **dict.fromkeys([aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.add.Scalar, aten.sub.Scalar,
                     aten.clone.default, aten.contiguous.default, aten.to.dtype, aten.to.dtype_layout,
                     aten.to.device, aten._to_copy.default, aten.sum.dim_IntList, aten.mean.dim, aten.cat.default,
                     aten.embedding.default, aten.mul.Scalar, aten.div.Scalar, aten.index_copy.default,
                     aten.repeat_interleave.self_int], _nothing),
    **dict.fromkeys(VIEWS, _nothing),
    **dict.fromkeys([aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default, aten.mul.Tensor],
                    _product),
    aten.div.Tensor: _divide,
    **dict.fromkeys([aten.gelu.default, aten.silu.default, aten.erf.default, aten.pow.Tensor_Scalar,
                     aten.cos.default, aten.sin.default, aten.abs.default], _inputs(0)),
    **dict.fromkeys([aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
                     aten.sigmoid.default, aten.tanh.default, aten.exp.default, aten.relu.default,
                     aten.rsqrt.default, aten.sqrt.default], _output),
    aten.dropout.default: _dropout,
    aten.layer_norm.default: _layer_norm,
    aten.scaled_dot_product_attention.default: _attention,
    **dict.fromkeys([aten.where.self, aten.masked_fill.Scalar], _condition),
}


def _all_inputs(node, strategy, grad):
    return [(i, None) for i, src in enumerate(input_slots(node)) if is_placed(src)]


def kept(node: Node, strategy, grad: set) -> list[Kept]:
    """The activations ``node``'s backward keeps under ``strategy`` (none if no gradient flows through it)."""
    if node.op != "call_function" or node not in grad:
        return []
    slots = input_slots(node)
    found = []
    for slot, kind in _TABLE.get(node.target, _all_inputs)(node, strategy, grad):
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
        if item.tensor.target == aten.layer_norm.default:
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


def regathered(choice: dict, grad: set, on_tokens) -> set:
    """Token-split tensors that some op keeps gathered for its backward: the runtime stores this rank's
    piece and gathers it again in the backward instead (autotp.runtime.activations)."""
    return {tensor for tensor in kept_whole(choice, grad) if tensor in choice and on_tokens(tensor, choice[tensor])}
