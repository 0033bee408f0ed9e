"""Graph preparation before rules: split biases off matmuls, find fused projections."""
from __future__ import annotations

import itertools

import torch

from .rules import RULES, pointwise, slice_range, split, view
from .strategies import Context, is_placed
from .views import inverse_view_dim

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


def getattr_path(gm: torch.nn.Module, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def split_bias(gm: torch.fx.GraphModule) -> None:
    """linear(x, w, b) -> linear(x, w) + b and addmm(b, x, w) -> mm(x, w) + b.

    A row-split matmul yields partial sums; the bias must be added once, after they are reduced.
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


def fused_block_hints(gm: torch.fx.GraphModule, ctx: Context) -> dict:
    """(node, dim) -> block sizes, for tensors later split into pieces (fused q|k|v, gate|up).

    Walks back from each split through views and elementwise ops so that the producing
    matmul can offer a block-wise shard, giving each rank matching slices of every piece.
    """
    hints: dict = {}
    work = []
    for node in gm.graph.nodes:
        if RULES.get(node.target) is split:
            x = node.args[0]
            n = len(ctx.shape(x))
            at = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
            sizes = tuple(o.shape[at] for o in node.meta["val"])
            if len(sizes) > 1 and all(ctx.static(s) for s in sizes):
                work.append((x, at % n, sizes))
    work += _tiling_slices(gm, ctx)
    while work:
        node, dim, sizes = work.pop()
        if sizes in hints.setdefault((node, dim), set()):
            continue
        hints[(node, dim)].add(sizes)
        rule = RULES.get(node.target)
        if rule is view:
            src = [ctx.probe(s) for s in ctx.shape(node.args[0])]
            dst = [ctx.probe(s) for s in ctx.shape(node)]
            d = inverse_view_dim(src, dst, dim)
            if d is not None:
                work.append((node.args[0], d, sizes))
        elif rule is pointwise:
            out = ctx.shape(node)
            for a in node.all_input_nodes:
                shape = ctx.shape(a) if is_placed(a) else ()
                ad = dim - (len(out) - len(shape))
                if ad >= 0 and shape[ad] == out[dim]:
                    work.append((a, ad, sizes))
    return hints




def retarget_device(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """A graph captured on the meta device names that device in its factory calls and checks
    (arange(device=meta), _assert_tensor_metadata(device=meta)): point them at the real one."""
    meta = torch.device("meta")

    def swap(value):
        if isinstance(value, torch.device) and value == meta:
            return device
        if isinstance(value, (list, tuple)):
            return type(value)(swap(v) for v in value)
        return value

    for node in gm.graph.nodes:
        node.args = swap(node.args)
        node.kwargs = {k: swap(v) for k, v in node.kwargs.items()}
    gm.recompile()


def _tiling_slices(gm: torch.fx.GraphModule, ctx: Context) -> list:
    """Slices of one tensor whose ranges tile a dim exactly ([q|k|v] cut with x[..., a:b]): block hints."""
    found = []
    for node in gm.graph.nodes:
        ranges: dict = {}
        for user in node.users:
            bounds = slice_range(user, ctx) if user.args and user.args[0] is node else None
            if bounds:
                ranges.setdefault(bounds[0], set()).add(bounds[1:])
        for dim, spans in ranges.items():
            spans = sorted(spans)
            size = ctx.shape(node)[dim]
            tiles = len(spans) > 1 and spans[0][0] == 0 and spans[-1][1] == size and all(
                a[1] == b[0] for a, b in itertools.pairwise(spans))
            if tiles:
                found.append((node, dim, tuple(end - start for start, end in spans)))
    return found
