"""What a merge of heads with the batch is: a view of [B, H, ...] as [B*H, ...] (a sized view, or a flatten of dims
0 and 1), the sizes it is read at, and whether its heads have a fixed size.  The rewrites that undo such merges
(unmerge.py and the modules it runs) read these; they rewrite nothing themselves.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from autotp.ops.strategies import Context
from autotp.ops.table import op

aten = torch.ops.aten


def sizes_of(ctx: Context, node: Node) -> list[int]:
    return [ctx.probe(s) for s in ctx.shape(node)]


def flattens_heads(node: Node) -> bool:
    return node.target == aten.flatten.using_ints and tuple(node.args[1:3]) == (0, 1)


def merges_heads(node: Node, ctx: Context) -> bool:
    """``node`` views a [B, H, ...] tensor as [B*H, ...]."""
    if not (flattens_heads(node) or "sized_view" in op(node.target).tags) or not isinstance(node.args[0], Node):
        return False
    inner, outer = sizes_of(ctx, node.args[0]), sizes_of(ctx, node)
    return (
        len(inner) == len(outer) + 1 > 2
        and inner[0] * inner[1] == outer[0]
        and inner[2:] == outer[1:]
        and 1 not in inner[:2]
    )


def fixed_heads(merge: Node, ctx: Context) -> bool:
    """The merged dim after the batch has a fixed size (heads; not tokens merged with the batch into rows)."""
    return ctx.static(ctx.shape(merge.args[0])[1])
