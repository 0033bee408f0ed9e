"""``autotp::paged_attention`` (runtime/paged_attention.py), attention that reads a paged KV pool in place, split
by query heads: the pools ``[slots, kv heads, dim]`` held as the KV heads each rank's queries read (the same
grouping as FlexAttention's, ops/flex.head_reads), the block table and positions whole, the output
``[rows, heads, tokens, dim]`` split as the queries.  No collective: each rank reads its own heads' piece."""

from __future__ import annotations

from torch.fx import Node

from autotp.ops.flex import head_reads
from autotp.ops.strategies import Context, Strategy


def paged_heads(node: Node, ctx: Context) -> list[Strategy] | None:
    q, keys, values = node.args[:3]
    reads = head_reads(node, q, keys, values, ctx)
    if reads is None:
        return None
    return [Strategy(ctx.fill(node, {q: s, keys: held, values: held}), s) for s, held in reads]
