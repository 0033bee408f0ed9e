"""Biases split off the products that add them.

    before: y = linear(x, w, b)       | y = addmm(b, x, w)       | y = conv2d(x, w, b, ...)
    after:  y = add(linear(x, w), b)  | y = add(mm(x, w), b)     | y = add(conv2d(x, w, None, ...), view(b, [-1, 1, 1]))

Every model with biased projections (GPT-2, BERT, ViT's patch conv): a row-split product yields partial sums and
its bias must be added once.  Tests: tests/test_properties.py (random MLPs with and without biases),
tests/test_architectures.py.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from autotp.ops.table import op

aten = torch.ops.aten


def split_bias(gm: torch.fx.GraphModule) -> None:
    """linear(x, w, b) -> linear(x, w) + b, addmm(b, x, w) -> mm(x, w) + b and conv(x, w, b, ...) ->
    conv(x, w, None, ...) + b[:, None, ...].

    A row-split matmul (a conv over split input channels) yields partial sums; the bias must be added once: by one
    rank to the partial sums (strategies.adds_once) or after they are reduced.
    """
    for node in list(gm.graph.nodes):
        bias_shape = None
        if node.target == aten.linear.default and len(node.args) > 2 and node.args[2] is not None:
            x, w, b = node.args
            matmul_args = (x, w)
            target = aten.linear.default
        elif node.target == aten.addmm.default and not node.kwargs:
            b, x, w = node.args
            matmul_args = (x, w)
            target = aten.mm.default
        elif op(node.target).family == "convolution" and len(node.args) > 2 and isinstance(node.args[2], Node):
            b, target = node.args[2], node.target
            matmul_args = (*node.args[:2], None, *node.args[3:])
            bias_shape = [-1] + [1] * (node.meta["val"].dim() - 2)  # channels first: [C, 1, ...]
        else:
            continue
        with gm.graph.inserting_before(node):
            product = gm.graph.call_function(target, matmul_args, dict(node.kwargs))
            if bias_shape is not None:
                column = gm.graph.call_function(aten.view.default, (b, bias_shape))
                column.meta = {**node.meta, "val": b.meta["val"].view(bias_shape)}
                b = column
            total = gm.graph.call_function(aten.add.Tensor, (product, b))
        for new in (product, total):
            new.meta = dict(node.meta)
        node.replace_all_uses_with(total)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
