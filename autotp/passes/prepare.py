"""Graph preparation before rules: split biases off matmuls, find fused projections."""
from __future__ import annotations

import itertools
import operator

import torch
from torch.fx import Node

from autotp.ops.expert_rules import hint_sources
from autotp.ops.flex import FLEX
from autotp.ops.layout_rules import cut_range, positive_dim
from autotp.ops.semantics import may_alias, written
from autotp.ops.strategies import Context, is_placed
from autotp.ops.table import op
from autotp.ops.views import inverse_view_dim, split_runs, view_groups
from autotp.passes.group_cuts import group_blocks

aten = torch.ops.aten


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


def drop_no_ops(gm: torch.fx.GraphModule) -> None:
    """Remove what only costs dispatch time at run time and hides the graph's structure from the rules:
    torch.export's dtype/device assertions, casts to the dtype a tensor already has (``to`` without copy
    returns its input; ``x.type_as(y)`` is such a cast that reads ``y`` for its dtype only), copies into contiguous
    memory that no reader needs (``_any_layout``), slices of everything
    (``x[:, :, a:b]`` slices dims 0 and 1 whole first), and in-place adds into a new tensor that nothing else reads
    (Falcon's ``mlp_output += attention_output``)."""
    for node in list(gm.graph.nodes):
        if node.target == aten.type_as.default:
            node.target, node.args = aten.to.dtype, (node.args[0], node.args[1].meta["val"].dtype)
        if node.target == aten._assert_tensor_metadata.default and not node.users:
            gm.graph.erase_node(node)
        elif node.target == aten.slice.Tensor and len(node.args) <= 4 and _whole(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        elif node.target == aten.add_.Tensor and _fresh(node.args[0]) and len(node.args[0].users) == 1:
            node.target = aten.add.Tensor
        elif node.target == aten.contiguous.default and len(node.args) == 1 and not node.kwargs and _any_layout(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        elif node.target == aten.to.dtype and len(node.args) == 2 and not node.kwargs:
            source, out = node.args[0].meta.get("val"), node.meta.get("val")
            if isinstance(source, torch.Tensor) and isinstance(out, torch.Tensor) and source.dtype == out.dtype:
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
    gm.graph.lint()


def _any_layout(node: Node) -> bool:
    """Every reader of ``node`` takes it in any memory layout (no ``view``, nothing writes into it or a view of it): a
    ``contiguous`` before them changes no value, and whether it is captured at all depends on the device (the meta
    device's attention output is laid out otherwise than the CPU's), so a plan made on meta would not apply."""
    return bool(node.users) and not written(node) and all(
        user.op == "call_function" and user.target not in _NEEDS_LAYOUT for user in node.users)


_NEEDS_LAYOUT = (aten.view.default, aten._unsafe_view.default)


def _fresh(node: Node) -> bool:
    """A tensor an op made anew (its schema says it aliases no input), not an input, parameter or view."""
    return node.op == "call_function" and not may_alias(node.target)


def getattr_path(gm: torch.nn.Module, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def split_bias(gm: torch.fx.GraphModule) -> None:
    """linear(x, w, b) -> linear(x, w) + b and addmm(b, x, w) -> mm(x, w) + b.

    A row-split matmul yields partial sums; the bias must be added once: by one rank to the partial
    sums (strategies.adds_once) or after they are reduced.
    """
    for node in list(gm.graph.nodes):
        if node.target == aten.linear.default and len(node.args) > 2 and node.args[2] is not None:
            x, w, b = node.args
            matmul_args = (x, w)
            target = aten.linear.default
        elif node.target == aten.addmm.default and not node.kwargs:
            b, x, w = node.args
            matmul_args = (x, w)
            target = aten.mm.default
        else:
            continue
        with gm.graph.inserting_before(node):
            product = gm.graph.call_function(target, matmul_args)
            total = gm.graph.call_function(aten.add.Tensor, (product, b))
        for new in (product, total):
            new.meta = dict(node.meta)
        node.replace_all_uses_with(total)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


def unflatten_products(gm: torch.fx.GraphModule) -> None:
    """view(x, [-1, h]) -> mm(., w) [+ b] -> view(., [*lead, n])  =>  matmul(x, w) [+ b] (GPT-2's Conv1D).

    Flattening tokens into rows hides the sequence dim from the product: a sequence-split input must then
    be gathered before the flattening view, and its gradient summed by an all-reduce after it, where
    Megatron-SP reduce-scatters.  The same product on the unflattened input keeps the dims visible.
    """
    graph = gm.graph
    for flat in list(graph.nodes):
        if op(flat.target).family != "view":
            continue
        x = flat.args[0]
        if not isinstance(x, Node) or len(flat.users) != 1 or not _flattens_rows(x, flat):
            continue
        mm = next(iter(flat.users))
        if mm.target != aten.mm.default or mm.args[0] is not flat or len(mm.users) != 1:
            continue
        tail, last = [mm], next(iter(mm.users))
        if last.target == aten.add.Tensor and last.args[0] is mm and _is_vector(last.args[1]) and len(last.users) == 1:
            tail, last = [mm, last], next(iter(last.users))
        if op(last.target).family != "view":
            continue
        out = last.meta.get("val")
        if not isinstance(out, torch.Tensor) or tuple(out.shape[:-1]) != tuple(x.meta["val"].shape[:-1]):
            continue
        with graph.inserting_before(last):
            value = graph.call_function(aten.matmul.default, (x, mm.args[1]))
            value.meta = {**mm.meta, "val": out}
            if len(tail) == 2:
                value = graph.call_function(aten.add.Tensor, (value, tail[1].args[1]))
                value.meta = {**tail[1].meta, "val": out}
        last.replace_all_uses_with(value)
        for node in (last, *reversed(tail), flat):
            graph.erase_node(node)
    graph.lint()
    gm.recompile()


def _flattens_rows(x: Node, flat: Node) -> bool:
    src, dst = x.meta.get("val"), flat.meta.get("val")
    return (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.dim() >= 3 and dst.dim() == 2
            and src.shape[-1] == dst.shape[-1])


def _is_vector(node) -> bool:
    return isinstance(node, Node) and isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].dim() == 1


def add_hints(gm: torch.fx.GraphModule, ctx: Context) -> None:
    """What the rules learn from downstream of a node: fused blocks, heads, the query heads KV heads serve."""
    ctx.hints = fused_block_hints(gm, ctx)
    ctx.covers = repeat_hints(gm)
    ctx.units = unit_hints(gm, ctx)
    ctx.block_units = block_unit_hints(gm, ctx)


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
    return cuts + _tiling_slices(gm, ctx)


def fused_block_hints(gm: torch.fx.GraphModule, ctx: Context) -> dict:
    """(node, dim) -> block sizes, for tensors later split into pieces (fused q|k|v, gate|up).

    Walks back from each split through views and elementwise ops so that the producing
    matmul can offer a block-wise shard, giving each rank matching slices of every piece.
    """
    return _walk_back([(x, dim, sizes) for x, dim, sizes, _ in _fused_cuts(gm, ctx)], ctx)


def block_unit_hints(gm: torch.fx.GraphModule, ctx: Context) -> dict:
    """(node, dim) -> {(block sizes, units per block)}: fused projections whose pieces are cut into
    heads of their own (Phi-3's [8 query heads | 2 KV heads | 2 KV heads]).  A piece without heads of
    its own is one unit when single KV heads are repeated (multi-query: every rank holds it).  Blocks
    repeated per group and read by gathers add (blocks, units, finer units, groups) (passes/group_cuts.py).

    Needs ``ctx.units`` and ``ctx.covers`` (unit_hints, repeat_hints)."""
    work = []
    for x, dim, sizes, pieces in _fused_cuts(gm, ctx):
        if _heads_dim(x, dim, ctx):  # each position is a head: a piece of n positions is n units
            units = list(sizes)
        else:
            units = [max(ctx.units.get((p, dim), {1 if 1 in ctx.covers else 0})) if p is not None else 0
                     for p in pieces]
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
        if node.target in (aten.scaled_dot_product_attention.default, FLEX):
            heads = [a.meta["val"].shape[1] if a.meta["val"].dim() == 4 else None for a in node.args[:3]]
            if heads[1:] == [1, 1] and isinstance(heads[0], int) and heads[0] > 1:
                covers.setdefault(1, set()).add(heads[0])
            elif node.target is FLEX and all(isinstance(h, int) for h in heads) and 1 < heads[1] < heads[0]:
                covers.setdefault(heads[1], set()).add(heads[0])  # FlexAttention's own grouped KV heads
        if node.target == aten.repeat_interleave.self_int:
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
        if op(node.target).family == "view":
            src = [ctx.probe(s) for s in ctx.shape(node.args[0])]
            dst = [ctx.probe(s) for s in ctx.shape(node)]
            for gi, gj in view_groups(src, dst):
                lead_in = [d for d in gi if src[d] != 1]
                lead_out = [d for d in gj if dst[d] != 1]
                if len(lead_in) == 1 and len(lead_out) > 1:
                    work.append((node.args[0], lead_in[0], dst[lead_out[0]]))
                if len(lead_in) > 1 and len(lead_out) == 1 and lead_out[0] == len(dst) - 1:  # heads merged back
                    work += [(b, len(ctx.shape(b)) - 2, src[lead_in[0]]) for user in node.users
                             if op(user.target).family == "matmul" and user.args[0] is node
                             for b in [user.args[1]] if len(ctx.shape(b)) >= 2]
    return _walk_back(work, ctx)


def _walk_back(work: list, ctx: Context) -> dict:
    """Hints (node, dim, value) spread back through views and elementwise ops to their producers."""
    hints: dict = {}
    while work:
        node, dim, sizes = work.pop()
        if sizes in hints.setdefault((node, dim), set()):
            continue
        hints[(node, dim)].add(sizes)
        family = op(node.target).family
        if family == "view":
            src = [ctx.probe(s) for s in ctx.shape(node.args[0])]
            dst = [ctx.probe(s) for s in ctx.shape(node)]
            d = inverse_view_dim(src, dst, dim)
            if d is not None:
                work.append((node.args[0], d, sizes))
            work += [(node.args[0], d, _in_flat_units(sizes, rest)) for d, out, rest in split_runs(src, dst)
                     if out == dim]
        elif family == "t":
            work.append((node.args[0], 1 - dim if len(ctx.shape(node)) == 2 else dim, sizes))
        elif family == "matmul" and dim == len(ctx.shape(node)) - 1 and len(ctx.shape(node.args[1])) >= 2:
            work.append((node.args[1], len(ctx.shape(node.args[1])) - 1, sizes))  # x @ w.t(): columns of w.t()
        elif family == "unsqueeze" and dim != positive_dim(node.args[1], len(ctx.shape(node))):
            work.append((node.args[0], dim - (dim > positive_dim(node.args[1], len(ctx.shape(node)))), sizes))
        elif family == "linear" and dim == len(ctx.shape(node)) - 1:
            work.append((node.args[1], 0, sizes))  # the weight's rows (a view of a parameter's, split apart)
        elif family == "getitem" and op(node.args[0].target).family == "split":
            work += _through_split(node, dim, sizes, ctx)
        elif family == "elementwise":
            out = ctx.shape(node)
            for a in node.all_input_nodes:
                shape = ctx.shape(a) if is_placed(a) else ()
                ad = dim - (len(out) - len(shape))
                if ad >= 0 and shape[ad] == out[dim]:
                    work.append((a, ad, sizes))
        else:
            work += [(src, d, sizes) for src, d in hint_sources(node, dim, ctx)]
    return hints


def _through_split(piece: Node, dim: int, hint, ctx: Context) -> list:
    """Block sizes hinted on one piece of a split, for the split tensor: that piece's blocks among the other pieces
    (nn.MultiheadAttention's cross-attention: in_proj_weight cut into [q | kv], kv cut into [k | v])."""
    parts, index = piece.args
    x = parts.args[0]
    at = positive_dim(parts.args[2] if len(parts.args) > 2 else parts.kwargs.get("dim", 0), len(ctx.shape(x)))
    sizes = [o.shape[at] for o in parts.meta["val"]]
    if dim != at or isinstance(hint, int) or not all(isinstance(c, int) for c in hint) or sum(hint) != sizes[index]:
        return []
    return [(x, at, (*sizes[:index], *hint, *sizes[index + 1:]))]


def _in_flat_units(hint, rest: int):
    """A hint on a heads dim, for the flat dim the heads were viewed from (blocks ``rest`` times longer)."""
    if isinstance(hint, int):
        return hint  # a unit count
    if isinstance(hint[0], int):
        return tuple(c * rest for c in hint)  # block sizes
    chunks, *units = hint  # units per block, and the finer units and groups they follow, if any
    return tuple(c * rest for c in chunks), *units


def fuse_repeat_kv(gm: torch.fx.GraphModule) -> None:
    """reshape(expand(x.unsqueeze(d + 1)), merging d and d + 1) -> x.repeat_interleave(n, d).

    This is how grouped-query attention repeats KV heads; as one op it can be sharded by heads
    even when ranks outnumber KV heads (ops/rules.py: repeat_heads).
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
        if at < 0 or big[:at + 1] + big[at + 2:] != src or not big[at + 1].isdigit() or not src[at].isdigit():
            continue
        repeats = int(big[at + 1])
        if out != [*big[:at], str(int(src[at]) * repeats), *big[at + 2:]]:
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
    while node.target == aten.slice.Tensor and len(node.args) <= 4 and _whole(node):
        node = node.args[0]
    return node


def _whole(node) -> bool:
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else None
    return start in (0, None) and (end is None or (isinstance(end, int) and end >= 2 ** 62))


def _tiling_slices(gm: torch.fx.GraphModule, ctx: Context) -> list:
    """Slices of one tensor whose ranges tile a dim exactly ([q|k|v] cut with x[..., a:b])."""
    found = []
    for node in gm.graph.nodes:
        ranges: dict = {}
        for user in node.users:
            cuts = user.target in (aten.slice.Tensor, aten.index.Tensor) and user.args[0] is node
            bounds = cut_range(user) if cuts else None
            if bounds:
                ranges.setdefault(bounds[0], {})[bounds[1:]] = user
        for dim, cut in ranges.items():
            spans = sorted(cut)
            size = ctx.shape(node)[dim]
            tiles = len(spans) > 1 and spans[0][0] == 0 and spans[-1][1] == size and all(
                a[1] == b[0] for a, b in itertools.pairwise(spans))
            if tiles:
                found.append((node, dim, tuple(end - start for start, end in spans), [cut[s] for s in spans]))
    return found
