"""In-place ops on new tensors, out of place.

    before: s = softmax(x); m = masked_fill_(s, mask, 0); read(s)
    after:  s = softmax(x); m = masked_fill(s, mask, 0); read(m)

Falcon's ``mlp_output += attention_output``, DeBERTa's softmax output zeroed by ``masked_fill_`` (which autograd
refuses: softmax's backward reads the output it overwrote), Funnel's ``scores[..., :n] *= mask``: the same values,
one less write for the rules.  Test: tests/test_in_place.py.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from autotp.ops.semantics import may_alias, writes

aten = torch.ops.aten


def out_of_place(gm: torch.fx.GraphModule) -> None:
    """An in-place op on a new tensor that no other view shares -> its out-of-place twin, read by what comes after it
    (Falcon's ``mlp_output += attention_output``; DeBERTa's softmax output zeroed by ``masked_fill_``, which autograd
    refuses: softmax's backward reads the output it overwrote).  The same values, one less write for the rules."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.name.endswith("_") or not node.args:
            continue
        x = node.args[0]
        twin = getattr(getattr(aten, schema.name.split("::")[-1][:-1], None), schema.overload_name or "default", None)
        if (
            twin is None
            or not isinstance(x, Node)
            or not _unseen(x)
            or not writes(node, x)
            or any(user.op != "call_function" or may_alias(user.target) for user in x.users)
        ):
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(twin, node.args, node.kwargs)
        new.meta = dict(node.meta)
        order[new] = order[node]
        node.replace_all_uses_with(new)
        x.replace_all_uses_with(new, delete_user_cb=lambda user, at=order[node]: order.get(user, -1) > at)
        gm.graph.erase_node(node)
    gm.graph.lint()


def _fresh(node: Node) -> bool:
    """A tensor an op made anew (its schema says it aliases no input), not an input, parameter or view."""
    return node.op == "call_function" and not may_alias(node.target)


def _unseen(node: Node) -> bool:
    """A new tensor, or a view of one that nothing else reads, each base read by the view on it alone (Funnel's
    ``scores[..., :n] *= mask``): a write into it shows only through the in-place op's result."""
    while node.op == "call_function" and may_alias(node.target) and node.args and isinstance(node.args[0], Node):
        if len(node.args[0].users) != 1:
            return False
        node = node.args[0]
    return _fresh(node)
