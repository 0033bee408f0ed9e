"""Hints for the rules, read from downstream of each node: the blocks of fused projections, head counts, and
the query heads each KV head is repeated to; and from upstream, the blocks of values joined from pieces.  The
rules offer shards by these units (ops/strategies.py)."""

from __future__ import annotations

import itertools
import operator
from dataclasses import replace

import torch

from autotp.canonicalize.group_cuts import group_blocks
from autotp.ops.layout_rules import cut_range, einsum_terms, positive_dim
from autotp.ops.quantized_rules import block_units
from autotp.ops.strategies import Context
from autotp.ops.table import op
from autotp.ops.views import merged_runs, split_runs, view_groups


def with_hints(gm: torch.fx.GraphModule, ctx: Context) -> Context:
    """``ctx`` with what the rules learn from downstream of a node: fused blocks, heads, the query heads KV heads
    serve (each found with the ones before it known)."""
    cuts, joins = fused_block_hints(gm, ctx), join_hints(gm, ctx)
    hints = {key: cuts.get(key, set()) | joins.get(key, set()) for key in {*cuts, *joins}}
    ctx = replace(ctx, hints=hints, covers=repeat_hints(gm))
    ctx = replace(ctx, units=unit_hints(gm, ctx))
    return replace(ctx, block_units=block_unit_hints(gm, ctx))


def _fused_cuts(gm: torch.fx.GraphModule, ctx: Context) -> list:
    """(tensor, dim, block sizes, the node holding each block) for every tensor cut into pieces along a
    dim: by split / chunk, or by slices that tile it ([q|k|v] cut with x[..., a:b])."""
    cuts = []
    for node in gm.graph.nodes:
        if op(node.target).family == "split":
            x = node.args[0]
            n = len(ctx.shape(x))
            at = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
            sizes = tuple(o.shape[at] for o in node.meta["val"])
            if len(sizes) > 1 and all(ctx.static(s) for s in sizes):
                pieces = {user.args[1]: user for user in node.users if user.target is operator.getitem}
                cuts.append((x, at % n, sizes, [pieces.get(k) for k in range(len(sizes))]))
        elif op(node.target).family == "unbind" and len(node.meta["val"]) > 1:  # [3, heads, d] -> q, k, v
            x = node.args[0]
            at = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(ctx.shape(x))
            pieces = {user.args[1]: user for user in node.users if user.target is operator.getitem}
            cuts.append((x, at, (1,) * len(node.meta["val"]), [pieces.get(k) for k in range(len(node.meta["val"]))]))
        elif "halves" in op(node.target).tags:  # gated halves: [a | b] -> a * sigmoid(b)
            x = node.args[0]
            n = len(ctx.shape(x))
            at = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)) % n
            if ctx.static(ctx.shape(x)[at]) and ctx.shape(x)[at] % 2 == 0:
                cuts.append((x, at, (ctx.shape(x)[at] // 2,) * 2, [None, None]))
    return cuts + _tiling_slices(gm, ctx) + _tiling_selects(gm, ctx)


def fused_block_hints(gm: torch.fx.GraphModule, ctx: Context) -> dict:
    """(node, dim) -> block sizes, for tensors later split into pieces (fused q|k|v, gate|up).

    Walks back from each split through views and elementwise ops so that the producing
    matmul can offer a block-wise shard, giving each rank matching slices of every piece.
    """
    return _walk_back([(x, dim, sizes) for x, dim, sizes, _ in _fused_cuts(gm, ctx)], ctx)


def join_hints(gm: torch.fx.GraphModule, ctx: Context) -> dict:
    """(node, dim) -> block sizes, for values joined from pieces along a dim (two kinds of heads concatenated,
    ConvBERT's; a feature map and the input it is fused with, MobileViT's) and for what they are viewed as, moved
    to or combined with on the way to the op that reads them: its weight may then follow the blocks, each piece
    split as it was made (a split's hints, walked forwards)."""
    work = []
    for node in gm.graph.nodes:
        if "joins" in op(node.target).tags and len(node.args[0]) > 1:
            n = len(ctx.shape(node))
            at = positive_dim(node.args[1] if len(node.args) > 1 else 0, n)
            sizes = tuple(ctx.shape(p)[at] if len(ctx.shape(p)) == n else None for p in node.args[0])
            if all(isinstance(v, int) for v in sizes):
                work.append((node, at, sizes))
        work += _tiled_copies(node, ctx)
    hints: dict = {}
    products = []  # products that read joined blocks: their other operands are offered the same blocks
    while work:
        node, dim, sizes = work.pop()
        if sizes not in hints.setdefault((node, dim), set()):
            hints[(node, dim)].add(sizes)
            if op(node.target).family == "einsum":
                products.append((node, dim, sizes))
            work += [found for user in node.users for found in _forward(user, node, dim, sizes, ctx)]
    back = _walk_back(products, ctx)
    return {key: hints.get(key, set()) | back.get(key, set()) for key in {*hints, *back}}


def _copied_dim(node) -> int | None:
    """The one dim ``x.repeat(sizes)`` copies, a whole number of times (tiled KV heads: query head i reads KV head
    i % kv); None for any other node."""
    if "repeats_tiled" not in op(node.target).tags:
        return None
    sizes = node.args[1]
    copied = [d for d, m in enumerate(sizes) if m != 1]
    return copied[0] if len(copied) == 1 and isinstance(sizes[copied[0]], int) else None


def _tiled_copies(node, ctx: Context) -> list:
    """A tiled repeat's copied dim is m blocks of x's, each split alike (ops/along_rules.repeat)."""
    at = _copied_dim(node)
    held = ctx.shape(node.args[0]) if at is not None else ()
    if at is None or len(node.args[1]) != len(held) or not ctx.static(held[at]):
        return []
    return [(node, at, (held[at],) * node.args[1][at])]


def _forward(user, node, dim: int, sizes: tuple, ctx: Context) -> list:
    """Where ``user`` carries blocks of ``node``'s dim: a view keeping it or merging it first with later dims, a
    dim move, a copy or an elementwise op of the same shape."""
    row = op(user.target)
    if row.family == "einsum":
        found = einsum_terms(user)
        terms, kept = found if found is not None else ([], "")
        return [
            (user, kept.index(term[dim]), sizes)
            for term, x in zip(terms, user.args[1], strict=True)
            if x is node and term[dim] in kept and ctx.shape(user)[kept.index(term[dim])] == ctx.shape(node)[dim]
        ]
    if not user.args or user.args[0] is not node:
        return []
    if row.family == "view":
        src, dst = ([ctx.probe(s) for s in ctx.shape(v)] for v in (node, user))
        return [(user, out, tuple(c * rest for c in sizes)) for d, out, rest in merged_runs(src, dst) if d == dim]
    n = len(ctx.shape(node))
    if row.family == "transpose":
        a, b = positive_dim(user.args[1], n), positive_dim(user.args[2], n)
        return [(user, {a: b, b: a}.get(dim, dim), sizes)]
    if row.family == "permute":
        return [(user, [positive_dim(d, n) for d in user.args[1]].index(dim), sizes)]
    same = ctx.shape(user) == ctx.shape(node)
    return [(user, dim, sizes)] if same and ("copy" in row.tags or row.family == "elementwise") else []


def block_unit_hints(gm: torch.fx.GraphModule, ctx: Context) -> dict:
    """(node, dim) -> {(block sizes, units per block)}: fused projections whose pieces are cut into
    heads of their own (Phi-3's [8 query heads | 2 KV heads | 2 KV heads]).  A piece without heads of
    its own is one unit when single KV heads are repeated (multi-query: every rank holds it).  Blocks
    repeated per group and read by gathers add (blocks, units, finer units, groups) (canonicalize/group_cuts.py).

    Needs ``ctx.units`` and ``ctx.covers`` (unit_hints, repeat_hints)."""
    work = []
    for x, dim, sizes, pieces in _fused_cuts(gm, ctx):
        if _heads_dim(x, dim, ctx):  # each position is a head: a piece of n positions is n units
            units = list(sizes)
        else:
            units = [
                max(ctx.units.get((p, dim), {1 if 1 in ctx.covers else 0})) if p is not None else 0 for p in pieces
            ]
        if all(units) and any(u > 1 for u in units) and all(s % u == 0 for s, u in zip(sizes, units, strict=True)):
            work.append((x, dim, (sizes, tuple(units))))
    return _walk_back(work + group_blocks(gm, ctx), ctx)


def _heads_dim(node, dim: int, ctx: Context) -> bool:
    """``dim`` of ``node`` is the heads of a view that split a flat dim into (heads, head dim)."""
    if op(node.target).family != "view":
        return False
    src = [ctx.probe(s) for s in ctx.shape(node.args[0])]
    return any(out == dim for _, out, _ in split_runs(src, [ctx.probe(s) for s in ctx.shape(node)]))


def repeat_hints(gm: torch.fx.GraphModule) -> dict:
    """KV heads -> {query heads}: grouped-query attention's repeat_interleave (fuse_repeat_kv), so that
    KV heads can be held where the query heads that use them are; a single KV head that attention
    broadcasts to every query head (Falcon's multi-query) serves them all."""
    covers: dict = {}
    for node in gm.graph.nodes:
        if op(node.target).family == "attention":
            grouped = "grouped_kv" in op(node.target).tags  # a paged pool's KV heads: [slots, heads, dim]
            heads = [a.meta["val"].shape[1] if a.meta["val"].dim() in (4, 3 * grouped) else None for a in node.args[:3]]
            if heads[1:] == [1, 1] and isinstance(heads[0], int) and heads[0] > 1:
                covers.setdefault(1, set()).add(heads[0])
            elif grouped and all(isinstance(h, int) for h in heads) and 1 < heads[1] < heads[0]:
                covers.setdefault(heads[1], set()).add(heads[0])  # the kernel's own grouped KV heads
        at = _copied_dim(node)
        size = node.meta["val"].shape[at] if at is not None else None
        if isinstance(size, int):  # tiled copies held whole serve all (a repeat over tokens, symbolic, copies no heads)
            covers.setdefault(1, set()).add(size)
        if "repeats_each" in op(node.target).tags:
            x, repeats, at = node.args[:3]
            kv = x.meta["val"].shape[at]
            if isinstance(kv, int) and isinstance(repeats, int) and repeats > 1:
                covers.setdefault(kv, set()).add(kv * repeats)
    return covers


def unit_hints(gm: torch.fx.GraphModule, ctx: Context) -> dict:
    """(node, dim) -> unit counts, for flat dims later viewed as (units, rest): the heads of [b, s, H*d];
    and for the rows of a product's second operand that contract heads merged back ([b, s, H, d] viewed as
    [b, s, H*d], then ``@ w.T``: Falcon's dense), so its weight can be split by whole heads too.

    The producing matmul may then shard whole heads when H is not divisible by the world size
    (uneven), or hold one head of several ranks' worth when there are fewer heads than ranks.
    """
    work = []
    for node in gm.graph.nodes:
        if "quantized" in op(node.target).tags:  # whole blocks of a quantized product's inputs
            work += block_units(node, ctx)
        if op(node.target).family == "view":
            src = [ctx.probe(s) for s in ctx.shape(node.args[0])]
            dst = [ctx.probe(s) for s in ctx.shape(node)]
            for gi, gj in view_groups(src, dst):
                lead_in = [d for d in gi if src[d] != 1]
                lead_out = [d for d in gj if dst[d] != 1]
                if len(lead_in) == 1 and len(lead_out) > 1:
                    work.append((node.args[0], lead_in[0], dst[lead_out[0]]))
                if len(lead_in) > 1 and len(lead_out) == 1 and lead_out[0] == len(dst) - 1:  # heads merged back
                    work += [
                        (b, len(ctx.shape(b)) - 2, src[lead_in[0]])
                        for user in node.users
                        if op(user.target).family == "matmul" and user.args[0] is node
                        for b in [user.args[1]]
                        if len(ctx.shape(b)) >= 2
                    ]
    return _walk_back(work, ctx)


def _walk_back(work: list, ctx: Context) -> dict:
    """Hints (node, dim, value) spread back through views and elementwise ops to their producers."""
    hints: dict = {}
    while work:
        node, dim, sizes = work.pop()
        if sizes in hints.setdefault((node, dim), set()):
            continue
        hints[(node, dim)].add(sizes)
        row = op(node.target)
        work += row.dim_map(node, dim, sizes, ctx) if row.dim_map is not None else []
    return hints


def _tiling_slices(gm: torch.fx.GraphModule, ctx: Context) -> list:
    """Slices of one tensor whose ranges tile a dim exactly ([q|k|v] cut with x[..., a:b])."""
    found = []
    for node in gm.graph.nodes:
        ranges: dict = {}
        for user in node.users:
            cuts = "cut" in op(user.target).tags and user.args[0] is node
            bounds = cut_range(user) if cuts else None
            if bounds:
                ranges.setdefault(bounds[0], {})[bounds[1:]] = user
        for dim, cut in ranges.items():
            spans = sorted(cut)
            size = ctx.shape(node)[dim]
            tiles = (
                len(spans) > 1
                and spans[0][0] == 0
                and spans[-1][1] == size
                and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
            )
            if tiles:
                found.append((node, dim, tuple(end - start for start, end in spans), [cut[s] for s in spans]))
    return found


def _tiling_selects(gm: torch.fx.GraphModule, ctx: Context) -> list:
    """Selects of every index of a static dim (``qkv[0], qkv[1], qkv[2]``): blocks of one."""
    found = []
    for node in gm.graph.nodes:
        picked: dict = {}
        for user in node.users:
            if "picks" in op(user.target).tags and user.args[0] is node and isinstance(user.args[2], int):
                dim = positive_dim(user.args[1], len(ctx.shape(node)))
                if ctx.static(ctx.shape(node)[dim]):
                    picked.setdefault(dim, {})[user.args[2] % ctx.shape(node)[dim]] = user
        for dim, users in picked.items():
            size = ctx.shape(node)[dim]
            if isinstance(size, int) and size > 1 and len(users) == size:
                found.append((node, dim, (1,) * size, [users[k] for k in range(size)]))
    return found
