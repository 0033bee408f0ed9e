"""A new tensor filled slice by slice is the concatenation of what fills it.

    before: k = new_empty(kv, [.., nope + rope]); copy_(slice(k, -1, 0, nope), k_nope); copy_(slice(k, -1, nope), k_rot)
    after:  k = cat([k_nope, k_rot], -1)

MLA attention (DeepSeek-V3 and its descendants in transformers) builds its keys as
``k = kv.new_empty(..., nope + rope); k[..., :nope].copy_(k_nope); k[..., nope:].copy_(k_rot)``.  A write into a
slice has no sharding rule, so the keys, and with them the attention, would run whole on every rank.  Written as
``cat([k_nope, k_rot], -1)`` the rules see a concatenation along the head dim of two tensors split by heads.  Only an
exact fill is rewritten: slices of one dim that tile it, each written once by a value of its own shape and dtype,
all before anything reads the tensor.  Test: tests/test_slice_fills.py.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from autotp.ops.table import op

aten = torch.ops.aten


def fills_to_cat(gm: torch.fx.GraphModule) -> None:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed = False
    for node in list(gm.graph.nodes):
        fill = _fill(node, order) if node.op == "call_function" and "uninitialized" in op(node.target).tags else None
        if fill is None:
            continue
        dim, parts, readers = fill
        last = max((copy for _, copy in parts), key=order.__getitem__)
        with gm.graph.inserting_after(last):
            cat = gm.graph.call_function(aten.cat.default, ([src for src, _ in parts], dim))
        cat.meta = {**node.meta, "val": torch.cat([src.meta["val"] for src, _ in parts], dim)}
        for reader in readers:
            reader.replace_input_with(node, cat)
        for _, copy in parts:
            piece = copy.args[0]
            gm.graph.erase_node(copy)
            gm.graph.erase_node(piece)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


def _fill(node: Node, order: dict):
    """(dim, [(value, its copy_)] in slice order, the tensor's other readers), or None."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    pieces = [u for u in node.users if u.target == aten.slice.Tensor]
    readers = [u for u in node.users if u.target != aten.slice.Tensor]
    if len(pieces) < 2:
        return None
    spans, dims = [], set()
    for piece in pieces:
        span = _span(piece, value)
        copies = list(piece.users)
        if span is None or len(copies) != 1:
            return None
        copy = copies[0]
        if (
            copy.target != aten.copy_.default
            or copy.args[0] is not piece
            or copy.users
            or len(copy.args) > 2
            or copy.kwargs.get("non_blocking")
        ):
            return None
        src = copy.args[1]
        want, got = piece.meta.get("val"), src.meta.get("val") if isinstance(src, Node) else None
        if (
            not isinstance(got, torch.Tensor)
            or got.dtype != value.dtype
            or list(map(str, got.shape)) != list(map(str, want.shape))
        ):
            return None
        dims.add(span[0])
        spans.append((span[1], span[2], src, copy))
    if len(dims) != 1:
        return None
    dim = dims.pop()
    spans.sort(key=lambda s: s[0])
    ends = [0] + [end for _, end, _, _ in spans]
    if [start for start, _, _, _ in spans] != ends[:-1] or str(ends[-1]) != str(value.shape[dim]):
        return None  # gaps or overlaps, or a dim it does not cover
    if readers and max(order[c] for *_, c in spans) > min(order[r] for r in readers):
        return None  # read before it is whole
    return dim, [(src, copy) for _, _, src, copy in spans], readers


def _span(piece: Node, value: torch.Tensor):
    """(dim, start, end) of a step-1 slice with integer bounds, the end clamped to the dim's size."""
    args = piece.args
    dim = args[1] if len(args) > 1 else 0
    start = args[2] if len(args) > 2 else 0
    end = args[3] if len(args) > 3 else None
    step = args[4] if len(args) > 4 else 1
    if piece.kwargs or step != 1 or not isinstance(dim, int) or not isinstance(start, int | type(None)):
        return None
    dim %= value.dim()
    size = value.shape[dim]
    if not isinstance(size, int):
        return None
    start = start or 0
    end = size if end is None or (isinstance(end, int) and end >= size) else end
    if not isinstance(end, int) or not 0 <= start < end <= size:
        return None
    return dim, start, end
