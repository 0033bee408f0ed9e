"""Ops that change no value, dropped.

    before: _assert_tensor_metadata(x, ...); y = to(x, x.dtype); z = contiguous(y); s = slice(z, 0, 0, 2**63)
            c = type_as(a, b)
    after:  x (read directly); c = to(a, b.dtype)

torch.export's dtype/device assertions, casts to the dtype a tensor already has, copies into contiguous memory
no reader needs and slices of everything only cost dispatch time and hide the graph's structure from the rules
(Llama's rotary ``type_as``; a ``contiguous`` after attention that the meta device captures and the CPU does not).
Tests: tests/test_view_layouts.py (a dropped contiguous), tests/test_regions.py (``type_as``).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from autotp.canonicalize.graph_edits import whole_slice
from autotp.ops.semantics import written
from autotp.ops.table import op

aten = torch.ops.aten


def drop_no_ops(gm: torch.fx.GraphModule) -> None:
    """Remove what only costs dispatch time at run time and hides the graph's structure from the rules:
    torch.export's dtype/device assertions, casts to the dtype a tensor already has (``to`` without copy
    returns its input; ``x.type_as(y)`` is such a cast that reads ``y`` for its dtype only), copies into contiguous
    memory that no reader needs (``_any_layout``) and slices of everything (``x[:, :, a:b]`` slices dims 0 and 1
    whole first)."""
    for node in list(gm.graph.nodes):
        if node.target == aten.type_as.default:
            node.target, node.args = aten.to.dtype, (node.args[0], node.args[1].meta["val"].dtype)
        if node.target == aten._assert_tensor_metadata.default and not node.users:
            gm.graph.erase_node(node)
        elif whole_slice(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        elif node.target == aten.contiguous.default and len(node.args) == 1 and not node.kwargs and _any_layout(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        elif node.target == aten.to.dtype and len(node.args) == 2 and not node.kwargs:
            source, out = node.args[0].meta.get("val"), node.meta.get("val")
            if isinstance(source, torch.Tensor) and isinstance(out, torch.Tensor) and source.dtype == out.dtype:
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
    gm.graph.lint()


def _any_layout(node: Node) -> bool:
    """Every reader of ``node`` takes it in any memory layout (no ``view``, nothing writes into it or a view of it): a
    ``contiguous`` before them changes no value, and whether it is captured at all depends on the device (the meta
    device's attention output is laid out otherwise than the CPU's), so a plan made on meta would not apply."""
    return (
        bool(node.users)
        and not written(node)
        and all(user.op == "call_function" and "strided" not in op(user.target).tags for user in node.users)
    )
