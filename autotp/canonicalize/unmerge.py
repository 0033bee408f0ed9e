"""Attention layouts that hide the heads, made plain before the rules see them (the same values, other ops).

    before: [S, B*H, hd] views and picks (nn.MultiheadAttention), bmm / baddbmm on [B*H, ...] (BLOOM), ops between
            a [B*H, ...] merge and the product or view that ends it (SAM)
    after:  the same attention on [B, H, ...]: a split of the packed dim, views into finer dims and permutes, 4-D
            matmuls, the merges after the ops they passed

A head merged with a symbolic batch is no dim a rule can split, so q, k and v would be gathered.  The rewrites are
one module each (merged_picks, packed_picks, merged_views, merged_products, merged_rows), run here in the order
that lets each meet the forms the one before it leaves.  Tests: tests/test_torch_layers.py,
tests/test_merged_heads.py, tests/test_layouts.py, tests/test_sublayers.py.
"""

from __future__ import annotations

import torch

from autotp.canonicalize.graph_edits import erase_unused
from autotp.canonicalize.merged_picks import merged_picks
from autotp.canonicalize.merged_products import merged_products
from autotp.canonicalize.merged_rows import merged_rows
from autotp.canonicalize.merged_views import merged_views
from autotp.canonicalize.packed_picks import packed_picks
from autotp.ops.strategies import Context

aten = torch.ops.aten


def unmerge(gm: torch.fx.GraphModule) -> None:
    """All five rewrites, each where it applies."""
    probes = Context(world=1)
    merged_picks(gm, probes)
    packed_picks(gm)
    merged_views(gm, probes)
    for _ in range(4):  # a product's merge moved on by merged_rows reaches the next product, or a view back
        merged_products(gm, probes)
        merged_rows(gm, probes)
        merged_views(gm, probes)
    erase_unused(gm.graph, [n for n in gm.graph.nodes if n.target == aten.sym_size.int])  # a moved merge's size
    gm.graph.lint()
    gm.recompile()
