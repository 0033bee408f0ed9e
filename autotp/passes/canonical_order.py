"""The graph's ops enumerated in an order that depends on the graph alone, not on the order the model's Python
issued them: ops are named (``mul_3``) and fingerprinted in this order.

A model that loops over a set (transformers' ``for layer_type in set(config.layer_types)``) issues independent
subgraphs in an order that follows the process's hash seed, so names counted in captured order, fingerprints and
plans would differ between two ranks.  The program still runs in its captured order (random streams, autocast and
grad-mode regions, vmap levels keep their meaning); only the enumeration is canonical: the postorder of a walk from
the output through each op's arguments in their order, then the ops the output does not read (asserts, region
entries and exits), each after the lowest-ranked op it is tied to.
"""

from __future__ import annotations

import torch
from torch.fx import Node

_LEAVES = (torch.amp._exit_autocast, torch._C._set_grad_enabled)  # called with the value their region's entry returned


def canonical_order(graph: torch.fx.Graph) -> list[Node]:
    nodes = list(graph.nodes)
    rank: dict[Node, tuple] = {n: (0, i) for i, n in enumerate(n for n in nodes if n.op == "placeholder")}
    output = nodes[-1]

    def walk(root: Node, tier: int) -> None:
        stack = [(root, iter(root.all_input_nodes))]
        while stack:
            node, args = stack[-1]
            nxt = next((a for a in args if a not in rank), None)
            if nxt is not None:
                stack.append((nxt, iter(nxt.all_input_nodes)))
                continue
            stack.pop()
            rank.setdefault(node, (tier, len(rank)))

    walk(output, 1)
    rank.pop(output)
    exits = {
        n.args[0]: n
        for n in nodes
        if n.op == "call_function" and n.target in _LEAVES and n.args and isinstance(n.args[0], Node)
    }
    position = {n: i for i, n in enumerate(nodes)}
    regions = {}  # a region's entry and exit -> its ops between them
    for entry, leave in exits.items():
        regions[entry] = regions[leave] = nodes[position[entry] + 1 : position[leave]]
    left = [n for n in nodes if n not in rank and n is not output]
    anchors = {n: (_anchor(n, rank, regions), _describe(n)) for n in left}
    for n in sorted(left, key=anchors.__getitem__):
        walk(n, 2)
    rank[output] = (3, 0)
    return sorted(nodes, key=rank.__getitem__)


def _anchor(node: Node, rank: dict, regions: dict) -> tuple:
    """The lowest rank among what ``node`` reads, and for a region's entry or exit among the region's ops."""
    near = [rank[d] for d in node.all_input_nodes if d in rank]
    near += [rank[n] for n in regions.get(node, ()) if n in rank]
    return min(near) if near else (2, 0)


def _describe(node: Node) -> str:
    from autotp.passes.capture import target_name

    return f"{target_name(node.target)}{[a for a in node.args if not isinstance(a, Node)]}"
