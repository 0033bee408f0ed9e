"""What each op's backward keeps, for the op table's ``keeps`` column (ops/table.py): a list of (input slot, or None
for the output; kind, or None for the value).  passes/kept_tensors.py prices them as activation memory."""

from __future__ import annotations

import torch
from torch.fx import Node
from torch.fx.operator_schemas import normalize_function

from autotp.placement import Replicate, Shard


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
    """SDPA's fused kernels keep q, k, v, the mask, the output and the log-sum-exp of each row (fp32); keys and
    values repeated per query head are kept unrepeated where the program passes them so (``grouped``)."""
    mask = sum(isinstance(a, Node) for a in node.args[3:4]) + isinstance(node.kwargs.get("attn_mask"), Node)
    kv = "grouped" if grouped_kv(node) else None
    return [(0, None), (1, kv), (2, kv), *((3, "additive") for _ in range(mask)), (None, None), (None, "stats")]


def grouped_kv(node: Node) -> int | None:
    """How many query heads share a KV head where attention without a mask reads its keys and values through
    one ``repeat_interleave`` of heads each (grouped-query attention): the rank's program passes them unrepeated
    (``enable_gqa``, ops/local_forms.attention), as transformers does in eager mode; None otherwise."""
    bound = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
    if bound["attn_mask"] is not None or bound["enable_gqa"]:
        return None
    found = {heads_repeated(bound["key"]), heads_repeated(bound["value"])}
    return found.pop() if len(found) == 1 and None not in found else None


def heads_repeated(kv) -> int | None:
    """n where ``kv`` is ``repeat_interleave(x, n, 1)`` of attention's 4-d keys or values, else None."""
    if not isinstance(kv, Node) or kv.target != torch.ops.aten.repeat_interleave.self_int or kv.kwargs:
        return None
    _, repeats, *at = kv.args
    return repeats if isinstance(repeats, int) and at and heads_dim(kv, at[0]) else None


def heads_dim(kv: Node, at: int) -> bool:
    """``at`` is attention's heads dim of 4-d ``kv``."""
    return kv.meta["val"].dim() == 4 and at % 4 == 1


def whole_groups(placement, heads: int, repeats: int, world: int) -> bool:
    """Every rank holds whole groups of ``repeats`` query heads in ``placement`` (of ``heads`` along dim 1): its
    heads then read its own KV heads in order, unrepeated."""
    if isinstance(placement, Replicate):
        return True
    if not isinstance(placement, Shard) or placement.dim != 1 or placement.chunks is not None:
        return False
    ranges = [placement.ranges(heads, rank, world) for rank in range(world)]
    return all(len(r) == 1 and r[0][0] % repeats == 0 and r[0][1] % repeats == 0 for r in ranges)


def keeps_index(node, grad):
    return [(1, None)]  # gather / scatter(x, dim, index, ...): the index (input slot 1) routes the gradient


def keeps_condition(node, grad):
    return [(0, None)]  # where / masked_fill: the boolean condition


def dropout_rate(node) -> float:
    """A dropout captured in training mode drops (in eval mode it is the identity)."""
    return node.args[1] if node.args[2] else 0.0
