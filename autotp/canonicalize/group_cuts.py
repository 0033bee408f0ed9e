"""Heads packed per group and cut inside each group, read as gathers of heads by constant positions.

    before: g = view(x, [b, s, G, H/G + 2, d]); q = slice(g, 3, 0, -2); k = index(g, [.., [-2]]); ...
            q = reshape(q, [b, s, H, d]); k = reshape(expand(k, [b, s, G, H/G, d]), [b, s, H, d])
    after:  f = view(x, [b, s, G*(H/G + 2), d]); q = index(f, [.., positions_0]); k = index(f, [.., positions_1])

Falcon's new decoder architecture packs its fused projection per KV group, ``[b, s, groups, H/groups + 2, d]``,
cuts query heads and one key and one value out of each group (``x[:, :, :, :-2]``, ``x[:, :, :, [-2]]``),
broadcasts the key and value over the group's query heads and flattens (groups, heads) back into heads.  With
fewer groups than ranks a rank must hold part of a group: its query heads and the group's key and value,
which no shard of the 5-D view can say (it would cut two dims).  The same values, read as
``x.view(b, s, groups * (H/groups + 2), d)[:, :, positions]`` with one constant list of positions per cut, are
one dim cut by gathers; rules (layout_rules.gather) check rank by rank that each rank's heads read only
positions it holds, and ``group_blocks`` names the layout to offer: the blocks of one group, repeated
(placement.Shard ``groups``).  Tests: tests/test_kv_layouts.py (Falcon's groups).
"""

from __future__ import annotations

import itertools
import math

import torch
from torch.fx import Node

from autotp.canonicalize.graph_edits import module_path
from autotp.ops.layout_rules import constant_positions, cut_range
from autotp.ops.strategies import Context, concrete
from autotp.ops.table import op

aten = torch.ops.aten


def cuts_to_gathers(gm: torch.fx.GraphModule) -> None:
    """view(x, [.., A, B, ..]) whose every use cuts B (a slice, or an index by a constant run), maybe
    broadcasts the piece along B, and merges (A, B') back into one dim  =>  one gather each from
    view(x, [.., A*B, ..]).  Exact by construction (the same elements in the same order); left alone when
    a use does anything else or the cut positions are unknown (a meta capture)."""
    graph = gm.graph
    for node in list(graph.nodes):
        chains = _group_chains(node) if _resizes(node) and node.users else None
        if chains is None:
            continue
        shape = [concrete(n) for n in node.meta["val"].shape]
        at, groups, width = chains[0][0], shape[chains[0][0] - 1], shape[chains[0][0]]
        sizes = list(node.args[1])
        merged = (
            -1
            if -1 in sizes[at - 1 : at + 1] or not all(isinstance(n, int) for n in sizes[at - 1 : at + 1])
            else sizes[at - 1] * sizes[at]
        )
        if merged == -1 and sizes.count(-1) > (-1 in sizes[at - 1 : at + 1]):
            continue
        with graph.inserting_before(node):
            flat = graph.call_function(node.target, (node.args[0], [*sizes[: at - 1], merged, *sizes[at + 1 :]]))
        flat.meta = {**node.meta, "val": node.meta["val"].flatten(at - 1, at)}
        for size in [user for user in node.users if user not in _cuts(node)]:
            size.args = (flat, *size.args[1:])  # a leading dim, the same in both views (_group_chains)
        for _, start, length, copies, cut, chain in chains:
            positions = [
                g * width + start + (j if length == copies else 0) for g in range(groups) for j in range(copies)
            ]
            merge = chain[-1]
            with graph.inserting_before(merge):
                target, value = _constant(gm, cut, positions, node.meta["val"].device)
                index = graph.create_node("get_attr", target)  # a plain tensor, as export's own constants
                index.meta["val"] = value
                picked = graph.call_function(aten.index.Tensor, (flat, [None] * (at - 1) + [index]))
            picked.meta = dict(merge.meta)
            merge.replace_all_uses_with(picked)
            inputs = []
            for dead in reversed(chain):
                inputs += dead.all_input_nodes
                graph.erase_node(dead)
            _drop_unused(graph, inputs)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()


def _resizes(node: Node) -> bool:
    """A view given its new sizes (view / reshape; not flatten)."""
    return op(node.target).family == "view" and len(node.args) > 1 and isinstance(node.args[1], (list, tuple))


def _group_chains(view: Node) -> list | None:
    """For a view splitting a dim into (A, B, ..) with A > 1: per use, (B's dim, start, length, copies, cut,
    [cut, broadcast?, merge]); None unless every use is such a chain."""
    shape = [concrete(n) for n in view.meta["val"].shape]
    chains = []
    for cut in _cuts(view):
        bounds = cut_range(cut) if "cut" in op(cut.target).tags else None
        if bounds is None or bounds[0] < 1 or len(cut.users) != 1:
            return None
        at, start, end = bounds
        if not all(isinstance(n, int) for n in shape[at - 1 : at + 1]) or shape[at - 1] < 2:
            return None
        chain, piece = [cut], _sizes(cut)
        user = next(iter(cut.users))
        if op(user.target).family == "expand" and end - start == 1 and len(user.users) == 1:
            out = _sizes(user)
            if out[:at] + out[at + 1 :] != piece[:at] + piece[at + 1 :]:
                return None
            chain, piece, user = [cut, user], out, next(iter(user.users))
        merged = _sizes(user) if op(user.target).family == "view" else None
        if merged != [*piece[: at - 1], piece[at - 1] * piece[at], *piece[at + 1 :]]:
            return None
        chains.append((at, start, end - start, piece[at], cut, [*chain, user]))
    at = {c[0] for c in chains}
    leading = all(user.args[1] % len(shape) < min(at) - 1 for user in view.users if user not in _cuts(view))
    return chains if len(at) == 1 and leading else None


def _cuts(view: Node) -> list:
    """The uses of ``view`` other than reading one of its sizes (a decode step reads the batch size)."""
    return [user for user in view.users if user.target != aten.sym_size.int]


def _sizes(node: Node) -> list:
    """Static sizes as ints, symbolic ones by name (compared without guarding on them)."""
    return [n if isinstance(n, int) else str(n) for n in map(concrete, node.meta["val"].shape)]


def _constant(gm: torch.fx.GraphModule, near: Node, positions: list[int], device) -> tuple[str, torch.Tensor]:
    """Store the positions as a constant of the module that made the cut (so identical blocks stay alike); real
    even for a meta model: they are known from the graph alone."""
    owner = module_path(near)
    try:
        module = gm.get_submodule(owner)
    except AttributeError:
        owner, module = "", gm
    k = 0
    while hasattr(module, f"autotp_positions_{k}"):
        k += 1
    value = torch.tensor(positions, dtype=torch.int64, device="cpu" if device.type == "meta" else device)
    setattr(module, f"autotp_positions_{k}", value)
    return (f"{owner}.autotp_positions_{k}" if owner else f"autotp_positions_{k}"), value


def _drop_unused(graph: torch.fx.Graph, nodes: list) -> None:
    """The cuts' own positions (a constant and its copy) once nothing reads them."""
    while nodes:
        node = nodes.pop()
        if not node.users and (node.op == "get_attr" or node.target == aten.lift_fresh_copy.default):
            nodes += node.all_input_nodes
            graph.erase_node(node)


def group_blocks(gm: torch.fx.GraphModule, ctx: Context) -> list:
    """(tensor, dim, (blocks, units, finer units, groups)) for every dim read by gathers whose positions,
    together, are blocks of one group repeated: per group g of ``groups``, gather k's heads
    g*F .. (g+1)*F - 1 (F = finer units / groups) read its block of that group in order, each position
    serving F / (block length) of them (a key read by all of its group's query heads)."""
    reads: dict = {}
    for node in gm.graph.nodes:
        found = constant_positions(node) if node.target == aten.index.Tensor and cut_range(node) is None else None
        if found is not None:
            reads.setdefault((node.args[0], found[0]), []).append(found[1])
    work = []
    for (x, dim), lists in reads.items():
        hint = _grouping(lists, ctx.shape(x)[dim])
        if hint is not None:
            work.append((x, dim, hint))
    return work


def _grouping(lists: list, size: int):
    """(blocks, units, finer units, groups) that the gathers' position lists (one per gather, over a dim of
    ``size``) read as, for the fewest groups (more than one) that fit; None if none does.  Only an offer:
    the gather's rule still checks every rank."""
    of = len(lists[0])
    if any(len(p) != of for p in lists) or not isinstance(size, int):
        return None
    for groups in range(2, math.gcd(of, size) + 1):
        if of % groups or size % groups:
            continue
        serves, length = of // groups, size // groups
        blocks: dict = {}
        for p in lists:
            pattern = [v - h // serves * length for h, v in enumerate(p)]
            first = pattern[:serves]
            start, units = first[0], len(set(first))
            if (
                pattern != first * groups
                or serves % units
                or start < 0
                or start + units > length
                or first != [start + h * units // serves for h in range(serves)]
                or blocks.setdefault(start, units) != units
            ):
                break
        else:
            starts = sorted(blocks)
            if (
                starts[0] == 0
                and sum(blocks.values()) == length
                and all(a + blocks[a] == b for a, b in itertools.pairwise(starts))
            ):
                chunks = tuple(blocks[s] for s in starts)
                return chunks, chunks, of, groups
    return None
