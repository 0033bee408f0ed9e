"""Attention layouts that hide the heads, made plain before the rules see them (the same values, other ops).

``F.multi_head_attention_forward`` (nn.MultiheadAttention, nn.Transformer*Layer) picks q, k and v out of its packed
in_proj output with an unflatten, dim moves and selects, and merges the heads with the batch ([S, B*H, hd]) before
viewing them back as [B, H, S, hd]; BLOOM computes attention on [B*H, ...] with ``baddbmm`` / ``bmm``.  A head merged
with a symbolic batch is no dim a rule can split, so q, k and v would be gathered: here the picks become a split of
the packed dim (its weight then splits block by block, S(0|E,E,E)), and merged views and products are rewritten on
[B, H, ...] (a view into finer dims and a permute; a 4-D matmul).
"""
from __future__ import annotations

import operator
from copy import deepcopy

import torch
from torch.fx import Node

from autotp.ops.semantics import may_alias
from autotp.ops.strategies import Context
from autotp.ops.table import op
from autotp.passes.merged_rows import fixed_heads, flattens_heads, merged_picks, merged_rows, merges_heads, sizes_of
from autotp.passes.prepare import call

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
    _erase_unused(gm.graph, [n for n in gm.graph.nodes if n.target == aten.sym_size.int])  # a moved merge's size
    gm.graph.lint()
    gm.recompile()


def _erase_unused(graph: torch.fx.Graph, nodes) -> None:
    """Erase the given nodes that nothing reads any more, and then what only they read, back to the first op that
    is no pure view or product."""
    todo, erased = list(nodes), set()
    while todo:
        node = todo.pop()
        pure = node.op == "call_function" and (
            may_alias(node.target) or "pure" in op(node.target).tags or node.target == aten.sym_size.int)
        if pure and not node.users and node not in erased:
            todo += node.all_input_nodes
            graph.erase_node(node)
            erased.add(node)


# ---- packed q|k|v picked by select ---------------------------------------------------------------

def _moved(node: Node, prev: Node, labels: list):
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
        return [*labels[:at], *labels[at + 1:]] if labels[at] == "one" else None
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
        labels = _moved(users[0], node, labels)
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
        _erase_unused(graph, chain)


# ---- heads merged with the batch, viewed back ------------------------------------------------------

class _Atoms:
    """The dims of a tensor cut into the finest pieces a chain of views needs (atoms), in their order in the
    chain's input: each atom is a run of one input dim's indices, so any order of atoms is a permute of a view."""

    def __init__(self, sizes: list[int]):
        self.size: dict = {}
        self.dims = [[self._new(s)] for s in sizes]
        self.order = [d[0] for d in self.dims]
        self.dims_in = [list(d) for d in self.dims]  # each input dim's atoms

    def _new(self, size: int) -> int:
        self.size[len(self.size)] = size
        return len(self.size) - 1

    def _split(self, atom: int, outer: int) -> tuple[int, int]:
        """An atom cut into (outer, inner) runs, everywhere it appears."""
        pair = (self._new(outer), self._new(self.size[atom] // outer))
        self.order = [x for y in self.order for x in (pair if y == atom else (y,))]
        self.dims, self.dims_in = ([[x for y in d for x in (pair if y == atom else (y,))] for d in dims]
                                   for dims in (self.dims, self.dims_in))
        return pair

    def regroup(self, sizes: list[int]) -> bool:
        """The dims after a view to ``sizes``; False where no view gives them."""
        flat, dims, i = [a for d in self.dims for a in d], [], 0
        for want in sizes:
            group, got = [], 1
            while got < want:
                if i >= len(flat):
                    return False
                size = self.size[flat[i]]
                if want % (got * size) == 0:
                    group.append(flat[i])
                    got *= size
                    i += 1
                elif want % got == 0 and size % (want // got) == 0:
                    outer, flat[i] = self._split(flat[i], want // got)
                    group.append(outer)
                    got = want
                else:
                    return False
            dims.append(group)
        if i != len(flat):
            return False
        self.dims = dims
        return True


def merged_views(gm: torch.fx.GraphModule, ctx: Context) -> None:
    """``view`` merging a dim with part of its neighbour -> transposes -> ``view`` splitting them back into single
    dims (nn.MultiheadAttention: [S, B, E] -> [S, B*H, hd] -> [B*H, S, hd] -> [B, H, S, hd])  =>  one view of the
    input into those dims and a permute.  Where no view splits them back but the dim moves lead with heads merged
    with the batch (F.multi_head_attention_forward's bmm path: [B*H, S, hd] into ``baddbmm``), that merge alone is
    made after them (a flatten merged_rows and merged_products move on); where a merge of [B, H, ...] ends in a view
    into other merges ([B*H, S, hd] -> [S, B*H, hd] -> [S*B, E]), the input is permuted and reshaped."""
    graph = gm.graph
    for first in list(graph.nodes):
        if first.graph is not graph or not first.args or not isinstance(first.args[0], Node) or not (
                "sized_view" in op(first.target).tags or flattens_heads(first)):
            continue
        x = first.args[0]
        sizes = [sizes_of(ctx, n) for n in (x, first)]
        if {0, 1} & {*sizes[0], *sizes[1]}:
            continue  # a size 1 or 0 belongs to no dim alone
        atoms = _Atoms(sizes[0])
        if not atoms.regroup(sizes[1]) or all(len(d) == 1 for d in atoms.dims):
            continue  # no merge to undo
        node, chain = first, [first]
        while len(node.users) == 1:
            user = next(iter(node.users))
            n = len(atoms.dims)
            if user.target == aten.transpose.int and user.args[0] is node:
                a, b = user.args[1] % n, user.args[2] % n
                atoms.dims[a], atoms.dims[b] = atoms.dims[b], atoms.dims[a]
            elif user.target == aten.permute.default and user.args[0] is node:
                atoms.dims = [atoms.dims[d % n] for d in user.args[1]]
            else:
                break
            node = user
            chain.append(node)
        last = next(iter(node.users)) if len(node.users) == 1 else None
        if last is not None and "sized_view" in op(last.target).tags and 1 not in sizes_of(ctx, last):
            split_back = deepcopy(atoms)
            if split_back.regroup(sizes_of(ctx, last)):
                if all(len(d) == 1 for d in split_back.dims):
                    with graph.inserting_before(last):
                        result = _split_back(graph, x, first, last, split_back)
                elif merges_heads(first, ctx) and not _pieces(split_back):
                    with graph.inserting_before(last):
                        result = call(graph, aten.reshape.default, (_permuted(graph, x, split_back), last.args[1]),
                                      last)
                else:
                    continue
                last.replace_all_uses_with(result)
                graph.erase_node(last)
                _erase_unused(graph, chain)
                continue
        lead, *rest = atoms.dims
        if len(chain) > 1 and len(lead) == 2 and all(len(d) == 1 for d in rest) and not merges_heads(first, ctx):
            with graph.inserting_before(node):
                result = _lead_merged(graph, x, atoms, node, ctx)
            if result is not None:
                node.replace_all_uses_with(result)
                _erase_unused(graph, chain)


def _pieces(atoms: _Atoms) -> bool:
    """Whether an input dim was cut into several atoms."""
    return any(len(d) > 1 for d in atoms.dims_in)


def _split_back(graph: torch.fx.Graph, x: Node, first: Node, last: Node, atoms: _Atoms) -> Node:
    """One view of ``x`` into the single dims of ``last`` (its sizes as given there), permuted to their order."""
    final = [d[0] for d in atoms.dims]
    given, order = list(last.args[1]), [atoms.order.index(a) for a in final]
    viewed = graph.call_function(aten.view.default, (x, [given[final.index(a)] for a in atoms.order]))
    viewed.meta = {**first.meta, "val": x.meta["val"].view(
        [last.meta["val"].shape[final.index(a)] for a in atoms.order])}
    result = viewed
    if order != sorted(order):
        result = graph.call_function(aten.permute.default, (viewed, order))
        result.meta = {**last.meta, "val": viewed.meta["val"].permute(order)}
    if aten.reshape.default in (first.target, last.target):  # a reshape copies what no view can reach:
        result = graph.call_function(aten.contiguous.default, (result,))  # readers may view it (laguna)
        result.meta = {**last.meta, "val": result.args[0].meta["val"].contiguous()}
    return result


def _permuted(graph: torch.fx.Graph, value: Node, atoms: _Atoms) -> Node:
    """``value``, already cut into ``atoms``' order, permuted to the order its dims list them."""
    flat = [a for d in atoms.dims for a in d]
    order = [atoms.order.index(a) for a in flat]
    return value if order == sorted(order) else call(graph, aten.permute.default, (value, order), value)


def _lead_merged(graph: torch.fx.Graph, x: Node, atoms: _Atoms, like: Node, ctx: Context) -> Node | None:
    """``x`` viewed into ``atoms``, permuted, the two leading ones flattened; None where the second, the heads,
    has no fixed size or an atom of a symbolic dim has no size to give."""
    shape = ctx.shape(x)
    given = []
    for i, dim in enumerate(atoms.dims_in):
        if len(dim) == 1:
            given.append(shape[i] if ctx.static(shape[i]) else call(graph, aten.sym_size.int, (x, i), x))
        elif ctx.static(shape[i]):
            given += [atoms.size[a] for a in dim]
        else:
            return None
    heads = atoms.dims[0][1]
    at = atoms.order.index(heads)
    if not isinstance(given[at], int):
        return None
    viewed = x if len(given) == len(shape) else call(graph, aten.view.default, (x, given), like)
    return call(graph, aten.flatten.using_ints, (_permuted(graph, viewed, atoms), 0, 1), like)


# ---- products over heads merged with the batch -------------------------------------------------------

def _unmerged(node: Node, b: int, h: int, ctx: Context):
    """How the [b*h, ...] operand ``node`` is a [b, h, ...] value: (source, broadcast over b, transposes to apply),
    or None.  Sources: a view of a [b, h, ...] tensor, or ``x.repeat(b, 1, ...)`` of an [h, ...] one (BLOOM's
    alibi slopes); transposes of the other dims pass through."""
    moves = []
    while node.target == aten.transpose.int:
        n = len(ctx.shape(node))
        pair = (node.args[1] % n, node.args[2] % n)
        if 0 in pair:
            return None
        moves.append((pair[0] + 1, pair[1] + 1))
        node = node.args[0]
    src = node.args[0] if node.args and isinstance(node.args[0], Node) else None
    if src is None:
        return None
    inner = sizes_of(ctx, src)
    merges = "sized_view" in op(node.target).tags or flattens_heads(node)
    if merges and inner[:2] == [b, h] and inner[2:] == sizes_of(ctx, node)[1:]:
        return src, False, moves[::-1]
    if node.target == aten.repeat.default and len(node.args[1]) == len(inner) and inner[0] == h:
        first, *rest = node.args[1]
        times = ctx.probe(first.meta["val"] if isinstance(first, Node) else first)
        if times == b and all(r == 1 for r in rest):
            return src, True, moves[::-1]
    return None


def _broadcast(node, ctx: Context) -> bool:
    """A ``baddbmm`` input that one [1, ...] (or fewer dims) row broadcasts over all [B*H] rows."""
    shape = ctx.shape(node) if isinstance(node, Node) else ()
    return 0 < len(shape) < 3 or (len(shape) == 3 and shape[0] == 1)


def _built(graph: torch.fx.Graph, recipe) -> Node:
    src, broadcast, moves = recipe
    value = src
    steps = [(aten.unsqueeze.default, (0,))] * broadcast + [(aten.transpose.int, m) for m in moves]
    for target, extra in steps:
        value = call(graph, target, (value, *extra), src)
    return value


def _heads(node: Node, ctx: Context):
    """(B, H) of a [B*H, ...] product operand that views (through transposes) a [B, H, ...] tensor, H fixed."""
    while node.target == aten.transpose.int and 0 not in (node.args[1] % 3, node.args[2] % 3):
        node = node.args[0]
    if not merges_heads(node, ctx) or not fixed_heads(node, ctx):
        return None
    return tuple(sizes_of(ctx, node.args[0])[:2])


def _batched(node: Node, ctx: Context) -> bool:
    """bmm / baddbmm, or a matmul of two 3-D operands (the same product)."""
    return "batched_product" in op(node.target).tags or (node.target == aten.matmul.default and all(
        isinstance(a, Node) and len(ctx.shape(a)) == 3 for a in node.args[:2]))


def merged_products(gm: torch.fx.GraphModule, ctx: Context) -> None:
    """``bmm`` / ``baddbmm`` (or a 3-D ``matmul``) of [B*H, ...] operands (BLOOM's ``alibi.baddbmm(q, k^T)`` and
    ``probs.bmm(v)``)  =>  the 4-D matmul of the unmerged operands (``beta * input + alpha * (a @ b)``), and where
    the result is not only viewed back as [B, H, ...], a merge of it that merged_rows moves on (MVP's
    ``q.bmm(k^T).softmax(-1)``)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if not _batched(node, ctx):
            continue
        users = list(node.users)
        shapes = {tuple(sizes_of(ctx, u)) for u in users}
        back = bool(users) and all("sized_view" in op(u.target).tags for u in users) and len(shapes) == 1
        if back:
            (b, h, *rest), = shapes
            back = rest == sizes_of(ctx, node)[1:] and b * h == sizes_of(ctx, node)[0] and \
                ctx.static(ctx.shape(users[0])[1])
        if not back:
            found = {_heads(a, ctx) for a in node.args[:3] if isinstance(a, Node)} - {None}
            if len(found) != 1:
                continue
            (b, h), = found
        operands = node.args[:3] if node.target == aten.baddbmm.default else (None, *node.args[:2])
        recipes = [_unmerged(a, b, h, ctx) if a is not None else None for a in operands]
        if operands[0] is not None and recipes[0] is None and _broadcast(operands[0], ctx):
            recipes[0] = (operands[0], False, [])  # a mask alike for every row: alike for every (batch, head)
        if None in recipes[1:] or (operands[0] is not None and recipes[0] is None):
            continue
        like = users[0] if back else node
        with graph.inserting_before(node):
            bias, left, right = (_built(graph, r) if r is not None else None for r in recipes)
            value = call(graph, aten.matmul.default, (left, right), like)
            alpha, beta = node.kwargs.get("alpha", 1), node.kwargs.get("beta", 1)
            if alpha != 1:
                value = call(graph, aten.mul.Tensor, (value, alpha), like)
            if bias is not None:
                bias = call(graph, aten.mul.Tensor, (bias, beta), like) if beta != 1 else bias
                value = call(graph, aten.add.Tensor, (bias, value), like)
            if not back:
                node.replace_all_uses_with(call(graph, aten.flatten.using_ints, (value, 0, 1), node))
        for user in users if back else ():
            user.replace_all_uses_with(value)
            graph.erase_node(user)
        graph.erase_node(node)
        _erase_unused(graph, [a for a in operands if a is not None])
