"""A batched product begun from zeros, a product.

    before: z = new_zeros(x, [b*H, s, s]); y = baddbmm(z, q, k, alpha=a)
    after:  y = mul(bmm(q, k), a)

GPT-NeoX-Japanese starts its scores from a zeros tensor of [batch * heads, s, s]: a bmm of heads merged with the
batch is what merged_products rewrites on [batch, heads, ...].  Test: tests/test_ops.py (a score matrix begun
from zeros by ``baddbmm``).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from autotp.ops.table import op

aten = torch.ops.aten


def drop_zero_bias(gm: torch.fx.GraphModule) -> None:
    """baddbmm(zeros, a, b, alpha=k) -> bmm(a, b) * k (GPT-NeoX-Japanese starts its scores from a zeros tensor of
    [batch * heads, s, s]): a bmm of heads merged with the batch is what unmerge rewrites on [batch, heads, ...]."""
    for node in list(gm.graph.nodes):
        zero = node.args[0] if node.target == aten.baddbmm.default else None
        if not isinstance(zero, Node) or "zeros" not in op(zero.target).tags:
            continue
        alpha = node.args[4] if len(node.args) > 4 else node.kwargs.get("alpha", 1)
        with gm.graph.inserting_before(node):
            product = gm.graph.call_function(aten.bmm.default, tuple(node.args[1:3]))
            product.meta = dict(node.meta)
            if alpha != 1:
                product = gm.graph.call_function(aten.mul.Tensor, (product, alpha))
                product.meta = dict(node.meta)
        node.replace_all_uses_with(product)
        gm.graph.erase_node(node)
        if not zero.users:
            gm.graph.erase_node(zero)
