"""What each op's backward keeps, for the op table's ``keeps`` column (ops/table.py): a list of (input slot, or None
for the output; kind, or None for the value).  passes/kept_tensors.py prices them as activation memory."""

from __future__ import annotations

from torch.fx import Node


def keeps_nothing(node, grad):
    return []


def keeps_input(node, grad):
    return [(0, None)]


def keeps_output(node, grad):
    return [(None, None)]


def keeps_operands(node, grad):
    """a * b or a @ b: a's gradient needs b and b's needs a."""
    a, b = node.args[0], node.args[1]
    if not (isinstance(a, Node) and isinstance(b, Node)):
        return []  # scaled by a number: nothing kept
    return [(1, None)] * (a in grad) + [(0, None)] * (b in grad)


def keeps_divisor(node, grad):
    a, b = node.args[0], node.args[1]
    if not isinstance(b, Node):
        return []
    return [(1, None)] + [(0, None)] * (b in grad and isinstance(a, Node))


def keeps_mask(node, grad):
    """Dropout keeps a one-byte mask (CUDA's ``native_dropout``); eval mode and p = 0 return the input itself."""
    return [(None, "mask")] if 0 < dropout_rate(node) < 1 else []


def keeps_normalized(node, grad):
    """Layer norm: its input, and a mean and 1/std per row in fp32."""
    return [(0, None), (None, "stats")]


def keeps_attention(node, grad):
    """SDPA's fused kernels keep q, k, v, the mask, the output and the log-sum-exp of each row (fp32)."""
    mask = sum(isinstance(a, Node) for a in node.args[3:4]) + isinstance(node.kwargs.get("attn_mask"), Node)
    return [(0, None), (1, None), (2, None), *((3, "additive") for _ in range(mask)), (None, None), (None, "stats")]


def keeps_index(node, grad):
    return [(1, None)]  # gather / scatter(x, dim, index, ...): the index (input slot 1) routes the gradient


def keeps_condition(node, grad):
    return [(0, None)]  # where / masked_fill: the boolean condition


def dropout_rate(node) -> float:
    """A dropout captured in training mode drops (in eval mode it is the identity)."""
    return node.args[1] if node.args[2] else 0.0
