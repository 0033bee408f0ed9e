"""Grouped-query attention's repeat of KV heads, one op.

    before: u = unsqueeze(kv, 2); e = expand(u, [b, kv_heads, n, s, d]); r = reshape(e, [b, kv_heads * n, s, d])
    after:  r = repeat_interleave(kv, n, 1)

Llama, Mistral, Qwen (``repeat_kv``): as one op it can be sharded by heads even when ranks outnumber KV heads
(ops/rules.py: repeat_interleave).  Test: tests/test_architectures.py (KV heads fewer than ranks).
"""

from __future__ import annotations

import torch

from autotp.canonicalize.graph_edits import whole_slice
from autotp.ops.table import op

aten = torch.ops.aten


def fuse_repeat_kv(gm: torch.fx.GraphModule) -> None:
    """reshape(expand(x.unsqueeze(d + 1)), merging d and d + 1) -> x.repeat_interleave(n, d).

    This is how grouped-query attention repeats KV heads; as one op it can be sharded by heads
    even when ranks outnumber KV heads (ops/rules.py: repeat_interleave).
    """
    for node in list(gm.graph.nodes):
        if op(node.target).family != "view":
            continue
        expanded = _skip_noop_slices(node.args[0])
        if expanded.target != aten.expand.default:
            continue
        unsqueezed = _skip_noop_slices(expanded.args[0])
        if unsqueezed.target != aten.unsqueeze.default:
            continue
        x = unsqueezed.args[0]
        big, out, src = (list(map(str, n.meta["val"].shape)) for n in (expanded, node, x))
        at = unsqueezed.args[1] % len(big) - 1
        if at < 0 or big[: at + 1] + big[at + 2 :] != src or not big[at + 1].isdigit() or not src[at].isdigit():
            continue
        repeats = int(big[at + 1])
        if out != [*big[:at], str(int(src[at]) * repeats), *big[at + 2 :]]:
            continue
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(aten.repeat_interleave.self_int, (x, repeats, at))
        fused.meta = dict(node.meta)
        node.replace_all_uses_with(fused)
        dead = node
        while dead is not x and not dead.users:  # the chain back to x, unless something else reads it
            source = dead.args[0]
            gm.graph.erase_node(dead)
            dead = source
    gm.graph.lint()
    gm.recompile()


def _skip_noop_slices(node):
    while whole_slice(node):
        node = node.args[0]
    return node
