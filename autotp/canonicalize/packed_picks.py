"""Packed q|k|v picked apart by ``select``, a split.

    before: u = unflatten(qkv, -1, [3, E]); t = transpose(unsqueeze(u, 0), 0, -2); s = squeeze(t, -2)
            q = select(s, 0, 0); k = select(s, 0, 1); v = select(s, 0, 2)
    after:  p = split(qkv, E, -1); q = contiguous(p[0]); k = contiguous(p[1]); v = contiguous(p[2])

``F.multi_head_attention_forward`` (nn.MultiheadAttention, nn.Transformer*Layer) picks q, k and v out of its packed
in_proj output so; as a split of the packed dim its weight splits block by block, S(0|E,E,E).
Test: tests/test_torch_layers.py (packed picks and merged heads unmerged).
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from autotp.canonicalize.graph_edits import erase_unused
from autotp.ops.table import op

aten = torch.ops.aten


def _labels_after(node: Node, prev: Node, labels: list):
    """Where the dims (``labels``) of ``prev`` are in ``node``, a pure dim move of it; None for any other op."""
    if not node.args or node.args[0] is not prev:
        return None
    n = len(labels)
    if "copy" in op(node.target).tags:
        return labels
    if node.target == aten.unsqueeze.default:
        at = node.args[1] % (n + 1)
        return [*labels[:at], "one", *labels[at:]]
    if node.target == aten.squeeze.dim:
        at = node.args[1] % n
        return [*labels[:at], *labels[at + 1 :]] if labels[at] == "one" else None
    if node.target == aten.transpose.int:
        a, b = node.args[1] % n, node.args[2] % n
        labels = list(labels)
        labels[a], labels[b] = labels[b], labels[a]
        return labels
    if node.target == aten.permute.default:
        return [labels[d % n] for d in node.args[1]]
    return None


def _picks(unflattened: Node, dim: int, ndim: int):
    """(the selects, the chain before them) if ``unflattened``'s pieces dim reaches selects along it through dim
    moves that leave every other dim where it was in the unflattened tensor's input; else None."""
    labels = [*range(dim), "pieces", *range(dim, ndim)]
    node, chain = unflattened, [unflattened]
    while True:
        users = list(node.users)
        if users and all(u.target == aten.select.int and u.args[0] is node for u in users):
            break
        if len(users) != 1:
            return None
        labels = _labels_after(users[0], node, labels)
        if labels is None:
            return None
        node = users[0]
        chain.append(node)
    at = labels.index("pieces")
    if [d for d in labels if d != "pieces"] != list(range(ndim)) or any(u.args[1] % len(labels) != at for u in users):
        return None
    return users, chain


def packed_picks(gm: torch.fx.GraphModule) -> None:
    """``x.unflatten(d, [k, n])``, its dims moved about (unsqueeze, transpose, squeeze, contiguous) and picked apart
    by ``select`` along the k dim  =>  ``split(x, n, d)[i]`` (copied contiguous, as the picks were): each pick is
    x's i-th block of n."""
    graph = gm.graph
    for unflattened in list(graph.nodes):
        if unflattened.target != aten.unflatten.int or unflattened.graph is not graph:
            continue
        x, dim, sizes = unflattened.args[:3]
        ndim = x.meta["val"].dim()
        dim %= ndim
        if len(sizes) != 2 or not all(isinstance(s, int) for s in sizes):
            continue
        found = _picks(unflattened, dim, ndim)
        if found is None:
            continue
        picks, chain = found
        block = int(unflattened.meta["val"].shape[dim + 1])
        with graph.inserting_after(x):
            parts = graph.call_function(aten.split.Tensor, (x, block, dim))
        parts.meta = {**unflattened.meta, "val": tuple(x.meta["val"].split(block, dim))}
        for pick in picks:
            index = pick.args[2] % len(parts.meta["val"])
            with graph.inserting_before(pick):
                item = graph.call_function(operator.getitem, (parts, index))
                item.meta = {**pick.meta, "val": parts.meta["val"][index]}
                copy = graph.call_function(aten.contiguous.default, (item,))
                copy.meta = {**pick.meta, "val": parts.meta["val"][index].contiguous()}
            pick.replace_all_uses_with(copy)
            graph.erase_node(pick)
        erase_unused(graph, chain)
