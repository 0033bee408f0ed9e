"""Heads merged with the batch and viewed back, one view and a permute.

    before: m = view(x, [S, B*H, hd]); t = transpose(m, 0, 1); y = view(t, [B, H, S, hd])    (x: [S, B, E])
    after:  y = permute(view(x, [S, B, H, hd]), [1, 2, 0, 3])

``F.multi_head_attention_forward`` (nn.MultiheadAttention, nn.Transformer*Layer; WavLM's ``need_weights`` path)
merges the heads with the batch before viewing them back: a head merged with a symbolic batch is no dim a rule can
split.  Tests: tests/test_torch_layers.py, tests/test_view_layouts.py.
"""

from __future__ import annotations

from copy import deepcopy

import torch
from torch.fx import Node

from autotp.canonicalize.batch_merges import flattens_heads, merges_heads, sizes_of
from autotp.canonicalize.graph_edits import call, erase_unused
from autotp.ops.strategies import Context
from autotp.ops.table import op

aten = torch.ops.aten


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
        self.dims, self.dims_in = (
            [[x for y in d for x in (pair if y == atom else (y,))] for d in dims] for dims in (self.dims, self.dims_in)
        )
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
        if (
            first.graph is not graph
            or not first.args
            or not isinstance(first.args[0], Node)
            or not ("sized_view" in op(first.target).tags or flattens_heads(first))
        ):
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
                elif merges_heads(first, ctx) and not _cut_input_dims(split_back):
                    with graph.inserting_before(last):
                        result = call(
                            graph, aten.reshape.default, (_permuted(graph, x, split_back), last.args[1]), last
                        )
                else:
                    continue
                last.replace_all_uses_with(result)
                graph.erase_node(last)
                erase_unused(graph, chain)
                continue
        lead, *rest = atoms.dims
        if len(chain) > 1 and len(lead) == 2 and all(len(d) == 1 for d in rest) and not merges_heads(first, ctx):
            with graph.inserting_before(node):
                result = _lead_merged(graph, x, atoms, node, ctx)
            if result is not None:
                node.replace_all_uses_with(result)
                erase_unused(graph, chain)


def _cut_input_dims(atoms: _Atoms) -> bool:
    """Whether an input dim was cut into several atoms."""
    return any(len(d) > 1 for d in atoms.dims_in)


def _split_back(graph: torch.fx.Graph, x: Node, first: Node, last: Node, atoms: _Atoms) -> Node:
    """One view of ``x`` into the single dims of ``last`` (its sizes as given there), permuted to their order."""
    final = [d[0] for d in atoms.dims]
    given, order = list(last.args[1]), [atoms.order.index(a) for a in final]
    viewed = graph.call_function(aten.view.default, (x, [given[final.index(a)] for a in atoms.order]))
    viewed.meta = {
        **first.meta,
        "val": x.meta["val"].view([last.meta["val"].shape[final.index(a)] for a in atoms.order]),
    }
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
