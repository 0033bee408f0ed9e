"""Views that borrow another tensor's shape, given its sizes.

    before: y = reshape_as(x, like)            (like: [b, s, H*d])
    after:  n = sym_size.int(like, 0); y = reshape(x, [n, s, H*d])

RoFormer merges its rotary heads back with ``reshape_as``: the view rules read sizes, not a tensor that only lends
its shape.  Test: tests/test_sublayers.py (RoFormer's ``reshape_as``).
"""

from __future__ import annotations

import torch
from torch.fx import Node

aten = torch.ops.aten


def spell_out_sizes(gm: torch.fx.GraphModule) -> None:
    """x.reshape_as(y) -> x.reshape(y's sizes), x.view_as(y) -> x.view(...): the view rules read sizes, not a tensor
    that only lends its shape (RoFormer's rotary); a dynamic size is read from y with sym_size."""
    spelled = {aten.reshape_as.default: aten.reshape.default, aten.view_as.default: aten.view.default}
    for node in list(gm.graph.nodes):
        if node.target not in spelled or not isinstance(node.args[1], Node):
            continue
        like = node.args[1]
        sizes = []
        for d, size in enumerate(like.meta["val"].shape):
            if isinstance(size, torch.SymInt):
                with gm.graph.inserting_before(node):
                    size_node = gm.graph.call_function(aten.sym_size.int, (like, d))
                size_node.meta = {**node.meta, "val": size}
                size = size_node
            sizes.append(size)
        node.target, node.args = spelled[node.target], (node.args[0], sizes)
    gm.graph.lint()
    gm.recompile()
