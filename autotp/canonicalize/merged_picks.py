"""q, k and v picked from heads merged with the batch, picked before the merge.

    before: m = reshape(qkv, [3, B*H, N, d]); q, k, v = unbind(m, 0)           (qkv: [3, B, H, N, d])
    after:  p = unbind(qkv, 0); q = reshape(p[0], [B*H, N, d]); ...          (each merge moved on by merged_rows.py)

SAM, SAM-HQ, ViTDet.  Test: tests/test_sublayers.py (heads merged with the batch around relative positions).
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from autotp.canonicalize.batch_merges import sizes_of
from autotp.canonicalize.graph_edits import call
from autotp.ops.strategies import Context
from autotp.ops.table import op

aten = torch.ops.aten


def merged_picks(gm: torch.fx.GraphModule, ctx: Context) -> None:
    """``x.reshape(k, B*H, ...)`` of x [k, B, H, ...] picked apart on its first dim (``unbind(0)``, ``select``)
    =>  the picks of x, each merged (SAM: ``qkv.reshape(3, B*H, N, d).unbind(0)``)."""
    graph = gm.graph
    for view in list(graph.nodes):
        if "sized_view" not in op(view.target).tags or not isinstance(view.args[0], Node):
            continue
        x = view.args[0]
        inner, outer = sizes_of(ctx, x), sizes_of(ctx, view)
        if not (
            len(inner) == len(outer) + 1 > 3
            and inner[0] == outer[0]
            and inner[1] * inner[2] == outer[1]
            and inner[3:] == outer[2:]
            and 1 not in inner[1:3]
            and view.users
            and all(_first_dim_pick(u) for u in view.users)
        ):
            continue
        merged = list(view.args[1][1:])
        with graph.inserting_before(view):
            for user in list(view.users):
                if user.target == aten.select.int:
                    picked = [(user, call(graph, aten.select.int, (x, 0, user.args[2]), user))]
                else:
                    parts = call(graph, aten.unbind.int, (x, 0), user)
                    picked = [(g, call(graph, operator.getitem, (parts, g.args[1]), g)) for g in user.users]
                for old, new in picked:
                    old.replace_all_uses_with(call(graph, aten.reshape.default, (new, merged), old))
                    graph.erase_node(old)
                if user.graph is graph and not user.users:
                    graph.erase_node(user)
        graph.erase_node(view)


def _first_dim_pick(node: Node) -> bool:
    if node.target == aten.select.int:
        return node.args[1] == 0
    return (
        node.target == aten.unbind.int
        and (len(node.args) < 2 or node.args[1] == 0)
        and all(u.target is operator.getitem for u in node.users)
    )
