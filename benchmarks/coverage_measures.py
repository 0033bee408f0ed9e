"""What the coverage sweep reads from a plan (benchmarks/coverage_sweep.py): block weights held per rank, forward
collectives per block against Megatron's, attention cores split by heads, and why ops ran replicated -- read from
the graph's structure, never from module names."""

from __future__ import annotations

import math
import re
from collections import Counter

import torch

_BLOCK = re.compile(r"^(.*?\.\d+)(\.|$)")


def _local(placement, shape: list, rank: int, world: int) -> int:
    from autotp.placement import Disjoint, Routed, Shard

    full = math.prod(shape)
    shard = placement.experts if isinstance(placement, (Routed, Disjoint)) else placement
    if not isinstance(shard, Shard) or not shape:
        return full
    ranks = placement.ranks if isinstance(placement, Routed) else world
    held = sum(n for _, n in shard.ranges(shape[shard.dim], min(rank, ranks - 1), ranks))
    return full // shape[shard.dim] * held


def measure(plan, model, gm, full: dict | None = None) -> dict:
    """What the plan does to the blocks: weight share a rank, forward collectives a block, heads split, replicated.
    The share weighs each parameter by its size in the full config where ``full`` has them (a 64-wide model's norms
    and position tables are a large part of it, a full one's are not), else by its own."""
    from autotp.placement import parse

    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    block_params = [n for n in plan.params if _BLOCK.match(n) and n in shapes and math.prod(shapes[n])]
    weight = {n: (full or {}).get(n, math.prod(shapes[n])) for n in block_params}
    total = sum(weight.values())
    share = (
        max(
            (
                sum(
                    _local(parse(plan.params[n]), shapes[n], r, plan.world_size) / math.prod(shapes[n]) * weight[n]
                    for n in block_params
                )
                / total
                for r in range(plan.world_size)
            ),
            default=1.0,
        )
        if total
        else None
    )
    blocks = {_BLOCK.match(n).group(1) for n in block_params}
    nodes = {n.name: n for n in gm.graph.nodes}
    found = [
        (k, v, _rank_of(nodes.get(k)))
        for k, v in plan.nodes.items()
        if _ATTENTION.search(v.get("op", "")) and ("softmax" not in v["op"] or _rank_of(nodes.get(k)) >= 3)
    ]  # a router's softmax is 2-D
    # per block, by heads: a core outside the numbered blocks (a pooling head's one query) runs once a model, and
    # one without a heads dim (one query per token over a few states, attention across depth) has none to split
    attention = [c for c in found if _numbered(c[1].get("module") or "") and _has_heads(nodes.get(c[0]))]
    cores = Counter(found[-1] for _, v, _ in attention for found in [_numbered(v.get("module") or "")] if found)
    per: dict = {b: Counter() for b in blocks}
    inner: dict = {}  # block -> modules inside it whose values a collective moves (beyond the sums of sublayers)
    for c in plan.collectives:
        module = _made_in(nodes.get(c["tensor"]), plan) or c["module"] or ""
        block = _block_of(module, cores)
        if c["phase"] == "forward" and block:
            node = nodes.get(c["tensor"])
            kind = (
                "statistics"
                if (c["op"] == "all_reduce" and _statistic(node))
                or (c["op"] == "all_gather" and _gathered_for_norm(node))
                else c["op"]
            )
            per.setdefault(block, Counter())[kind] += c.get("count", 1)
            if kind != "statistics":  # the module that made the value, and those a gathered value is read in
                readers = _readers(node, plan) if c["op"] == "all_gather" else set()
                inner.setdefault(block, set()).update(m for m in {module, *readers} if m.startswith(block + "."))
    calls = Counter(v.get("module") for v in plan.nodes.values() if v.get("op") == "aten.linear.default")
    residuals = Counter(v.get("module") for k, v in plan.nodes.items() if _residual(nodes.get(k)))
    worst, counts, extra, over_modules = 0, {}, [], set()
    for block, n in per.items():
        applied = max((k for m, k in calls.items() if m and _block_of(m, cores) == block), default=1)
        # one sum per attention core, one for the MLP (or mixer) each time the block runs; or one per sublayer
        # added to the residual stream (a conformer's two half-step FFNs, attention and conv module: four)
        megatron = max(cores[block] + applied, residuals[block])
        # an all-gather or a reduce-scatter is half an all-reduce (a ring all-reduce is one of each, same bytes):
        # Megatron-SP's pair counts one, and so do the two gathers of a residual stream split by channels
        effective = (
            n["all_reduce"]
            + math.ceil((n["reduce_scatter"] + n["all_gather"]) / 2)
            + math.ceil(n["all_to_all"] / 2)
            + sum(
                v
                for k, v in n.items()
                if k not in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "statistics")
            )
        )
        if effective - megatron > worst:
            extra = [
                f"{c['op']} of {c['tensor']} ({plan.nodes.get(c['tensor'], {}).get('op', '?')}) in {c['module']}"
                for c in plan.collectives
                if c["phase"] == "forward" and (c["module"] or "").startswith(block)
            ]
        worst = max(worst, effective - megatron)
        if effective > megatron:
            over_modules.update(inner.get(block, ()))
        counts[block] = dict(n, applied=applied) if applied > 1 else dict(n)
    unsplit = [
        f"{v['op']} in {v.get('module') or '?'}: out {v['out']}"
        for _, v, rank in attention
        if not _by_heads(v["out"], rank)
    ]
    replicated = plan.cost.get("replicated") or dict.fromkeys(plan.replicated_ops, "no sharding rule")
    return {
        "share": share,
        "blocks": len(blocks),
        "per_block": counts,
        "over_megatron": worst,
        "collectives": extra,
        "over_modules": sorted(over_modules),
        "attention_ops": len(attention),
        "unsplit_attention": unsplit[:3],
        "attention_not_counted": [
            f"{v['op']} in {v.get('module') or '?'}" for c in found if c not in attention for _, v, _ in [c]
        ][:3],
        "replicated": [f"{op}: {why}" for op, why in list(replicated.items())[:6]],
        "replicated_count": len(replicated),
    }


def _numbered(module: str) -> list[str]:
    """The module's numbered prefixes, outermost first: ``a.layers.1.mlp.experts.3`` -> ``a.layers.1``, ``...3``."""
    parts = module.split(".")
    return [".".join(parts[: i + 1]) for i, part in enumerate(parts) if part.isdigit()]


def _block_of(module: str, cores: Counter) -> str | None:
    """The block a collective of ``module`` is counted in: the innermost numbered module holding an attention core
    (ALBERT's and Funnel's layers inside a numbered group each count as a block), else the outermost numbered one."""
    numbered = _numbered(module)
    return next((p for p in reversed(numbered) if p in cores), numbered[0] if numbered else None)


def _made_in(node, plan) -> str | None:
    """The module whose op made the value a collective moves: back through layout ops, which move no data (ViTDet's
    next block starts by permuting the stream its last one left partial: that sum is the last block's), and through
    a cat of pieces of one value (Swin's patch merging: four strided slices of the last block's partial stream)."""
    node = _back(node)
    while node is not None and node.target in (torch.ops.aten.cat.default, torch.ops.aten.stack.default):
        sources = {_back(p) for p in node.args[0] if isinstance(p, torch.fx.Node)}
        if len(sources) != 1:  # a cat of pieces of one value (Swin's patch merging) moves that value
            break
        node = sources.pop()
    return plan.nodes.get(node.name, {}).get("module") if node is not None else None


def _back(node, through=None):
    """``node``'s source back through ops that pass their first operand on (``through``; layout ops by default)."""
    from autotp.ops.table import op

    through = through or (lambda n: op(n.target).layout)
    while node is not None and node.op == "call_function" and node.all_input_nodes and through(node):
        node = node.args[0] if isinstance(node.args[0], torch.fx.Node) else None
    return node


def _read_by(node) -> list:
    """The ops that read ``node``, forward through layout ops."""
    from autotp.ops.table import op

    found, todo, seen = [], [node] if node is not None else [], set()
    while todo:
        for user in todo.pop().users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "call_function" and op(user.target).layout:
                todo.append(user)
            else:
                found.append(user)
    return found


def _readers(node, plan) -> set[str]:
    """The modules whose ops read ``node`` (Jamba's ``x_proj`` reads the gathered output of the Mamba conv: a hand
    plan may compute that small projection whole)."""
    return {plan.nodes[u.name]["module"] for u in _read_by(node) if plan.nodes.get(u.name, {}).get("module")}


def _residual(node) -> bool:
    """An add of two tensors of its own shape: at a block's own level, a sublayer's output added to the stream."""
    if node is None or node.target != torch.ops.aten.add.Tensor:
        return False

    def text(val) -> list[str]:  # as text: a size only data knows (rows picked by a mask: u0, u1) is any such size
        return [re.sub(r"^u\d+$", "u", str(n)) for n in val.shape]

    shapes = [
        text(a.meta["val"]) if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) else None
        for a in node.args[:2]
    ]
    return shapes[0] is not None and shapes[0] == shapes[1] == text(node.meta["val"])


def _statistic(node) -> bool:
    """A norm's statistic summed over the ranks (a mean or sum of squares over a split hidden dim, one number a
    row): Megatron's count is of activations, and a hand plan of such a norm gathers the whole activation instead."""
    val = node.meta.get("val") if node is not None else None
    return (
        node is not None
        and node.target in (torch.ops.aten.mean.dim, torch.ops.aten.sum.dim_IntList)
        and isinstance(val, torch.Tensor)
        and val.dim() > 0
        and val.shape[-1] == 1
    )


def _gathered_for_norm(node) -> bool:
    """A product's output gathered for a norm over the width the plan split it by (a sub-LN, ESM-C's q and k norms
    over all heads): what a hand plan does (vLLM's and SGLang's OLMo-2 gather q and k for their norms), the other
    way to such a norm than its statistics.  Not a residual stream's gather (its source is an add or a norm)."""
    from autotp.ops.table import is_product, op

    def weight(n) -> bool:  # a parameter, or a view of one (a conv's bias viewed to broadcast)
        n = _back(n)
        return n is not None and n.op == "get_attr"

    def passes_on(n) -> bool:  # a layout op, a bias or an activation (elementwise, no other tensor but weights)
        row = op(n.target)
        return row.layout or (row.family == "elementwise" and all(weight(a) for a in n.all_input_nodes[1:]))

    def made(n) -> bool:  # a product, attention or a convolution: a sublayer's own value, not the stream
        return n.op == "call_function" and (is_product(n) or op(n.target).family == "convolution")

    source = _back(node, lambda n: not made(n) and passes_on(n))
    return (
        source is not None
        and made(source)
        and any(
            _statistic(u) or (u.op == "call_function" and op(u.target).family == "layer_norm") for u in _read_by(node)
        )
    )


_ATTENTION = re.compile(r"scaled_dot_product|_softmax|softmax\.|flex_attention")


def _rank_of(node) -> int:
    val = node.meta.get("val") if node is not None else None
    val = val[0] if isinstance(val, (tuple, list)) and val else val
    return val.dim() if isinstance(val, torch.Tensor) else 0


def _has_heads(node) -> bool:
    """[b, h, s, *] (or [b, g, h, s, *]) with a heads dim over 1, or [b*h, s, s] with heads in its first dim.  A
    dynamic input dim (a bare symbol: batch, tokens) is no heads dim, so a router's [b, s, experts] softmax is no
    attention; in [b, h, s, *] a size the capture left as an expression is heads where it is one number at any
    input sizes (SEW-D's, an expression that is always 4), not where it grows with them (DeepSeek-V4's compressor
    gates windows of 4 tokens: [b, s // 4, 4, d], no heads); in [b*h, s, s] any expression may be."""
    val = node.meta.get("val") if node is not None else None
    val = val[0] if isinstance(val, (tuple, list)) and val else val
    if not isinstance(val, torch.Tensor) or val.dim() < 3:
        return False
    if val.dim() == 3:
        return any(size > 1 if isinstance(size, int) else not size.node.expr.is_Symbol for size in val.shape[:1])
    return any(size > 1 if isinstance(size, int) else _fixed(size.node.expr) for size in val.shape[1:-2])


def _fixed(expr) -> bool:
    """An expression of the input sizes that has one value over 1 whatever they are (tried at two sets)."""
    if expr.is_Symbol:
        return False
    values = {
        int(expr.subs({s: base + 7 * i for i, s in enumerate(sorted(expr.free_symbols, key=str))}))
        for base in (10007, 20011)
    }
    return len(values) == 1 and values.pop() > 1


def _by_heads(placement: str, rank: int) -> bool:
    """An attention core's output split on a head dim: [b, h, s, *] (or [b, g, h, s, *]) on h, [b*h, s, s] on 0."""
    found = re.match(r"S\((\d+)", placement)
    if not found:
        return False
    dim = int(found.group(1))
    return 0 < dim < rank - 2 or (rank == 3 and dim == 0)
