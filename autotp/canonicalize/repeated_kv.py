"""Grouped-query attention's repeat of KV heads, one op.

    before: u = unsqueeze(kv, 2); e = expand(u, [b, kv_heads, n, s, d]); r = reshape(e, [b, kv_heads * n, s, d])
    after:  r = repeat_interleave(kv, n, 1)
    before: u = unsqueeze(kv, 1); e = expand(u, [b, n, kv_heads, s, d]); r = reshape(e, [b, n * kv_heads, s, d])
    after:  r = repeat(kv, [1, n, 1, 1])

Llama, Mistral, Qwen (``repeat_kv``): query head i reads KV head i // n; as one op it can be sharded by heads
even when ranks outnumber KV heads (ops/rules.py: repeat_interleave).  Test: tests/test_architectures.py (KV
heads fewer than ranks).  x-transformers (einops ``'b kvh n d -> b (r kvh) n d'``): query head i reads KV head
i % kv_heads, n copies of all KV heads; split block by block (ops/along_rules.repeat, hints.join_hints), each
rank's query heads read its own KV heads when the ranks divide the KV heads.  Test: tests/test_other_libraries.py.
"""

from __future__ import annotations

import torch

from autotp.canonicalize.graph_edits import whole_slice
from autotp.ops.table import op

aten = torch.ops.aten


def fuse_repeat_kv(gm: torch.fx.GraphModule) -> None:
    """reshape(expand(x.unsqueeze(d + 1)), merging d and d + 1) -> x.repeat_interleave(n, d);
    reshape(expand(x.unsqueeze(d)), merging d and d + 1) -> x.repeat(n at d).

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
        fused_op = _repeat_of(*(list(map(str, n.meta["val"].shape)) for n in (x, expanded, node)), unsqueezed.args[1])
        if fused_op is None:
            continue
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(*fused_op(x))
        fused.meta = dict(node.meta)
        node.replace_all_uses_with(fused)
        dead = node
        while dead is not x and not dead.users:  # the chain back to x, unless something else reads it
            source = dead.args[0]
            gm.graph.erase_node(dead)
            dead = source
    gm.graph.lint()
    gm.recompile()


def _repeat_of(src: list, big: list, out: list, new: int):
    """The op that makes ``out`` from ``src`` (``big``: src with a dim of copies at ``new``, which ``out``
    merges with a neighbour of src's), as x -> (target, args); None if ``out`` is not such a merge.  Copies
    after the dim they merge with repeat each of its indices in place; copies before it tile the whole dim."""
    new %= len(big)
    if big[:new] + big[new + 1 :] != src or not big[new].isdigit():
        return None
    copies = int(big[new])
    for at in (new - 1, new):  # src's dim that the copies merge with
        if not 0 <= at < len(src) or not src[at].isdigit():
            continue
        merged = list(src)
        merged[at] = str(int(src[at]) * copies)
        if out != merged:
            continue
        if at < new:
            return lambda x: (aten.repeat_interleave.self_int, (x, copies, at))
        sizes = [1] * len(src)
        sizes[at] = copies
        return lambda x: (aten.repeat.default, (x, sizes))
    return None


def _skip_noop_slices(node):
    while whole_slice(node):
        node = node.args[0]
    return node
