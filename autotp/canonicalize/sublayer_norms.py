"""Norms inside a sublayer, spelled out as their statistics.

    before: y = layer_norm(linear(x, w), [E], g, b, eps)
    after:  p = linear(x, w); c = sub(p, mean(p, [-1], True)); v = mean(mul(c, c), [-1], True)
            y = add(mul(mul(c, rsqrt(add(v, eps))), g), b)

A layer norm over a projection's output -- ESM-C's and OLMo-2's q and k norms over all heads, Magneto's sub-LN
before the output projection or inside the MLP -- normalizes a width that tensor parallelism splits by heads or
columns.  As one fused op it has no split form, so the plan would gather the whole activation around it.  Written as
its means (``x - mean``, the mean of the squares, ``rsqrt``) the rules split it like an RMSNorm written in Python: each
rank sums its columns, one all-reduce of a number a row per statistic.  A norm over the residual stream (its input an
add, an embedding, an input, or a value the residual add reads too) stays one op: one kernel is faster than five.
Tests: tests/test_sublayers.py (norms over a split width), tests/test_layouts.py (q and k norms).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from autotp.canonicalize.graph_edits import call
from autotp.ops.table import is_product, op

aten = torch.ops.aten
_LOW = (torch.float16, torch.bfloat16)  # fused kernels keep the statistics in float32: so does the spelled-out form


def spell_out_norms(gm: torch.fx.GraphModule) -> None:
    norms = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and op(n.target).family == "layer_norm" and _after_product(n.args[0])
    ]
    for node in norms:
        _spell_out(gm.graph, node)
    if norms:
        gm.graph.lint()
        gm.recompile()


def _after_product(x) -> bool:
    """``x`` comes from a matrix product (or attention) through views and elementwise ops of it alone (a bias,
    an activation, a dropout), and only the norm reads what they make: inside a sublayer.  The residual stream is
    read by the residual add too (a conformer's first norm on its input projection's output stays fused)."""
    while isinstance(x, Node) and x.op == "call_function" and len(x.users) == 1:
        if is_product(x):
            return True
        row = op(x.target)
        others = [
            a for a in x.all_input_nodes[1:] if a.op != "get_attr" and isinstance(a.meta.get("val"), torch.Tensor)
        ]
        if not (row.layout or row.family == "elementwise" or "per_row" in row.tags) or others:
            return False
        x = x.args[0]
    return False


def _spell_out(graph: torch.fx.Graph, node: Node) -> None:
    rms = node.target == aten.rms_norm.default
    x, shape = node.args[0], node.args[1]
    names = ("weight", "eps") if rms else ("weight", "bias", "eps")
    given = {**dict(zip(names, node.args[2:], strict=False)), **node.kwargs}
    weight, bias = given.get("weight"), given.get("bias")
    eps = given.get("eps", None if rms else 1e-5)
    dtype = x.meta["val"].dtype
    eps = torch.finfo(dtype).eps if eps is None else eps
    dims = list(range(-len(shape), 0))

    with graph.inserting_before(node):
        y = call(graph, aten.to.dtype, (x, torch.float32), node) if dtype in _LOW else x
        if not rms:
            y = call(graph, aten.sub.Tensor, (y, call(graph, aten.mean.dim, (y, dims, True), node)), node)
        squares = call(graph, aten.mul.Tensor, (y, y), node)
        variance = call(graph, aten.mean.dim, (squares, dims, True), node)
        scale = call(graph, aten.rsqrt.default, (call(graph, aten.add.Tensor, (variance, eps), node),), node)
        y = call(graph, aten.mul.Tensor, (y, scale), node)
        if weight is not None:
            y = call(graph, aten.mul.Tensor, (y, weight), node)
        if bias is not None:
            y = call(graph, aten.add.Tensor, (y, bias), node)
        if dtype in _LOW:
            y = call(graph, aten.to.dtype, (y, dtype), node)
    node.replace_all_uses_with(y)
    graph.erase_node(node)
