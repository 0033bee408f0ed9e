"""Products on tokens flattened into rows, taken on the unflattened tokens.

    before: f = view(x, [-1, h]); y = add(mm(f, w), b); out = view(y, [b, s, n])     (x: [b, s, h])
    after:  out = add(matmul(x, w), b)

GPT-2's Conv1D: flattening tokens into rows hides the sequence dim, so a sequence-split input would be gathered
before the view, where Megatron-SP reduce-scatters.  Test: tests/test_sequence_parallel.py (GPT-2).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from autotp.ops.table import op

aten = torch.ops.aten


def unflatten_products(gm: torch.fx.GraphModule) -> None:
    """view(x, [-1, h]) -> mm(., w) [+ b] -> view(., [*lead, n])  =>  matmul(x, w) [+ b] (GPT-2's Conv1D).

    Flattening tokens into rows hides the sequence dim from the product: a sequence-split input must then
    be gathered before the flattening view, and its gradient summed by an all-reduce after it, where
    Megatron-SP reduce-scatters.  The same product on the unflattened input keeps the dims visible.
    """
    graph = gm.graph
    for flat in list(graph.nodes):
        if op(flat.target).family != "view":
            continue
        x = flat.args[0]
        if not isinstance(x, Node) or len(flat.users) != 1 or not _flattens_rows(x, flat):
            continue
        mm = next(iter(flat.users))
        if mm.target != aten.mm.default or mm.args[0] is not flat or len(mm.users) != 1:
            continue
        tail, last = [mm], next(iter(mm.users))
        if last.target == aten.add.Tensor and last.args[0] is mm and _is_vector(last.args[1]) and len(last.users) == 1:
            tail, last = [mm, last], next(iter(last.users))
        if op(last.target).family != "view":
            continue
        out = last.meta.get("val")
        if not isinstance(out, torch.Tensor) or tuple(out.shape[:-1]) != tuple(x.meta["val"].shape[:-1]):
            continue
        with graph.inserting_before(last):
            value = graph.call_function(aten.matmul.default, (x, mm.args[1]))
            value.meta = {**mm.meta, "val": out}
            if len(tail) == 2:
                value = graph.call_function(aten.add.Tensor, (value, tail[1].args[1]))
                value.meta = {**tail[1].meta, "val": out}
        last.replace_all_uses_with(value)
        for node in (last, *reversed(tail), flat):
            graph.erase_node(node)
    graph.lint()
    gm.recompile()


def _flattens_rows(x: Node, flat: Node) -> bool:
    src, dst = x.meta.get("val"), flat.meta.get("val")
    return (
        isinstance(src, torch.Tensor)
        and isinstance(dst, torch.Tensor)
        and src.dim() >= 3
        and dst.dim() == 2
        and src.shape[-1] == dst.shape[-1]
    )


def _is_vector(node) -> bool:
    return isinstance(node, Node) and isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].dim() == 1
