"""Tied weights read through one node.

    before: w1 = get_attr[wte.weight]; w2 = get_attr[lm_head.weight]   (one tensor, two names)
            embedding(w1, ids) ... linear(h, w2)
    after:  w = get_attr[wte.weight]; embedding(w, ids) ... linear(h, w)

GPT-2 ties its output projection to its token embedding: one tensor must get one placement, so the rules see one
node.  Tests: tests/test_tied_norm_grads.py, tests/test_pipeline.py (tied embeddings on two stages).
"""

from __future__ import annotations

import torch

from autotp.canonicalize.graph_edits import getattr_path


def merge_aliases(gm: torch.fx.GraphModule) -> None:
    """One get_attr node per tensor: tied weights (GPT-2's wte = lm_head) get a single placement."""
    first: dict = {}
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        tensor = getattr_path(gm, node.target)
        if not node.users:
            gm.graph.erase_node(node)
        elif id(tensor) in first:
            node.replace_all_uses_with(first[id(tensor)])
            gm.graph.erase_node(node)
        else:
            first[id(tensor)] = node
    gm.graph.lint()
