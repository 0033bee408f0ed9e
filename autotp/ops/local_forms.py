"""This rank's form of one op, where the sharded op is not the same op on smaller tensors: size arguments cut
to the local piece, offsets of the rank's heads, rows, experts or blocks baked in (autotp/runtime/kernels.py).

Each function is an op row's ``local`` (ops/table.py): ``(node, strategy, rank, world)``, mutating ``node``.
"""

from __future__ import annotations

import math

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.fx.operator_schemas import normalize_function

from autotp.ops.channel_rules import conv_groups
from autotp.ops.expert_rules import GROUPED_MM_FALLBACK, is_grouped_mm, offsets
from autotp.ops.keeps import heads_dim, heads_repeated
from autotp.ops.layout_rules import block_of, constant_positions, cut_range, gathered, pieces_of
from autotp.ops.rules import held_heads, separate_pieces
from autotp.ops.strategies import token_inputs
from autotp.placement import Disjoint, Partial, R, Shard
from autotp.runtime import kernels
from autotp.runtime.dropout import Attention, Dropout


def full_size(node: Node, dim: int) -> int:
    return int(node.meta["val"].shape[dim])


def local_sizes(sizes, placement, rank: int, world: int):
    """A size list with the sharded dim cut to this rank's piece (-1 is left to infer)."""
    if not isinstance(placement, Shard):
        return sizes
    sizes = list(sizes)
    size = sizes[placement.dim]
    if isinstance(size, Node):
        raise AssertionError(f"sharded dim {placement.dim} has a symbolic size: rules must not allow this")
    if size != -1:
        sizes[placement.dim] = placement.local_size(size, rank, world)
    return sizes


def _source(strategy):
    return strategy.inputs[0] if strategy.inputs else None


def resize(node: Node, strategy, rank: int, world: int) -> None:
    """view / reshape / expand: the output's sharded dim at its local size."""
    node.args = (node.args[0], local_sizes(node.args[1], strategy.output, rank, world), *node.args[2:])


def unflatten(node: Node, strategy, rank: int, world: int) -> None:
    """unflatten(x, dim, sizes): a sharded dim among the new ones at its local size."""
    out = strategy.output
    x, at, sizes = node.args[:3]
    at %= x.meta["val"].dim()
    if isinstance(out, Shard) and at <= out.dim < at + len(sizes) and sizes[out.dim - at] != -1:
        sizes = list(sizes)
        sizes[out.dim - at] = out.local_size(sizes[out.dim - at], rank, world)
        node.args = (x, node.args[1], sizes, *node.args[3:])


def cut_block(node: Node, strategy, rank: int, world: int) -> None:
    """A slice (or an index by a constant run) that cuts one whole block out of a fused dim dealt out block by
    block: that block's range in this rank's piece."""
    src = _source(strategy)
    if not (isinstance(src, Shard) and src.chunks):
        return
    bounds = cut_range(node)
    if bounds is None and node.target == torch.ops.aten.index.Tensor:
        raise RuntimeError(
            f"{node.name} indexes a fused dim the plan splits block by block, but its positions "
            "are not known in this capture (a constant on the meta device?): plan with this model"
        )
    k = block_of(src, *bounds[1:]) if bounds and bounds[0] == src.dim else None
    if k is not None:
        lengths = [n for _, n in src.ranges(sum(src.chunks), rank, world)]
        start = sum(lengths[:k])
        node.target, node.kwargs = torch.ops.aten.slice.Tensor, {}
        node.args = (node.args[0], src.dim, start, start + lengths[k])


def index(node: Node, strategy, rank: int, world: int) -> None:
    """``x[..., positions, ...]``: a gather along the sharded dim reads this rank's heads from its own piece;
    a cut of one whole block, as a slice; ``w[ids]`` of whole experts, this rank's experts' rows."""
    src = _source(strategy)
    found = constant_positions(node) if cut_range(node) is None else None
    if isinstance(src, Shard) and found is not None and found[0] == src.dim:
        at, positions = found
        local = gathered(src, strategy.output, positions, node.args[0].meta["val"].shape[at], rank, world)
        node.target, node.args, node.kwargs = kernels.gather_positions, (node.args[0], at, tuple(local)), {}
    elif isinstance(strategy.output, Disjoint):
        own_experts(node, strategy, rank, world)
    else:
        cut_block(node, strategy, rank, world)


def split(node: Node, strategy, rank: int, world: int) -> None:
    """split / split_with_sizes along the sharded dim: this rank's piece of each part."""
    src = _source(strategy)
    at = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    if isinstance(src, Shard) and src.dim == at % node.args[0].meta["val"].dim():
        sizes = node.args[1]
        ranges = src.ranges(node.args[0].meta["val"].shape[src.dim], rank, world)
        local = [n for _, n in ranges] if isinstance(sizes, (list, tuple)) else ranges[0][1]
        pieces = pieces_of(src.chunks, [o.shape[src.dim] for o in node.meta["val"]]) if src.chunks else None
        if isinstance(sizes, (list, tuple)) and pieces and len(pieces) < len(local):  # pieces of several blocks
            local = [sum(local[k] for k in ks) for ks in pieces]
        node.args = (node.args[0], local, *node.args[2:])


def repeat_interleave(node: Node, strategy, rank: int, world: int) -> None:
    """repeat_interleave of KV heads: this rank's query heads from the KV heads it holds."""
    if not isinstance(strategy.output, Shard):
        return
    x, repeats, at = node.args[:3]
    kv, heads = x.meta["val"].shape[at], node.meta["val"].shape[at]
    in_start = held_heads(_source(strategy), at, kv, rank, world)[0]
    ((out_start, out_len),) = strategy.output.ranges(heads, rank, world)
    node.target, node.args, node.kwargs = kernels.repeat_heads, (x, repeats, at, in_start, out_start, out_len), {}


def repeat_slice(node: Node, strategy, rank: int, world: int) -> None:
    """x.repeat of x held whole (R, or whole units): this rank's slice of the copies."""
    src, out = _source(strategy), strategy.output
    if not isinstance(out, Shard) or out.chunks is not None or (isinstance(src, Shard) and not src.whole(world)):
        return
    ((start, length),) = out.ranges(node.meta["val"].shape[out.dim], rank, world)
    node.target, node.args, node.kwargs = kernels.repeat_range, (*node.args[:2], out.dim, start, length), {}


def partial_mean(node: Node, strategy, rank: int, world: int) -> None:
    """A mean over a sharded dim: this rank's sum over the full count (a partial sum)."""
    if not (isinstance(_source(strategy), Shard) and isinstance(strategy.output, Partial)):
        return
    x, dims = node.args[:2]
    shape = x.meta["val"].shape
    count = math.prod(int(shape[d]) for d in dims)
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    node.target, node.args = kernels.partial_mean, (x, dims, keepdim, count)
    node.kwargs = {k: v for k, v in node.kwargs.items() if k == "dtype"}


def add_once(node: Node, strategy, rank: int, world: int) -> None:
    """A partial sum plus a replicated operand: rank 0 alone adds the operand, the others add zeros."""
    if rank == 0 or not (isinstance(strategy.output, Partial) and R in strategy.inputs):
        return
    at = strategy.inputs.index(R)
    with node.graph.inserting_before(node):
        zeros = node.graph.call_function(kernels.added_by_rank0, (node.args[at],))
    zeros.meta = dict(node.args[at].meta)
    node.update_arg(at, zeros)


def own_experts(node: Node, strategy, rank: int, world: int) -> None:
    """Expert parallelism: this rank's experts compute their own tokens' rows, zeros the others'."""
    if not isinstance(strategy.output, Disjoint):
        return
    weight = node.args[1] if is_grouped_mm(node) else node.args[0]
    first, _ = strategy.output.owned(full_size(weight, 0), rank, world)
    if is_grouped_mm(node):
        fallback = str(node.target) == GROUPED_MM_FALLBACK
        node.target, node.args, node.kwargs = (
            kernels.expert_grouped_mm,
            (node.args[0], weight, offsets(node), first, fallback),
            {},
        )
    else:
        (ids,) = node.args[1]
        node.target, node.args, node.kwargs = kernels.expert_rows, (weight, ids, first), {}


def vocab_rows(node: Node, strategy, rank: int, world: int) -> None:
    """An embedding split by vocabulary: Megatron's masked lookup of this rank's rows."""
    src = _source(strategy)
    if not (isinstance(src, Shard) and src.dim == 0):
        return
    weight, ids = node.args[:2]
    ((start, _),) = src.ranges(weight.meta["val"].shape[0], rank, world)
    padding = node.args[2] if len(node.args) > 2 else -1
    node.target, node.args, node.kwargs = kernels.vocab_embedding, (weight, ids, start, padding), {}


def _stream_key(layout: Shard | None, size, rank: int, world: int) -> int:
    """Which stream a rank draws its piece of a mask from: the lowest rank holding the same piece."""
    if layout is None or not isinstance(size, int):
        return rank
    mine = layout.ranges(size, rank, world)
    return next(r for r in range(world) if layout.ranges(size, r, world) == mine)


def _to_module(node: Node, module: torch.nn.Module, args: tuple) -> None:
    """``node`` becomes a call of ``module``, a new submodule of the program."""
    name = f"autotp_{node.name}"
    node.graph.owning_module.add_submodule(name, module)
    node.op, node.target, node.args, node.kwargs = "call_module", name, args, {}


def _memory_order(value: torch.Tensor) -> tuple:
    """The dims of a (possibly symbolic) tensor from outermost to innermost in memory, at the example's sizes."""
    return tuple(sorted(range(value.dim()), key=lambda d: (-optimization_hint(value.stride(d), fallback=1), d)))


def _run_time_size(node: Node, size) -> Node:
    """The full length of a token dim at run time, read off the input it sizes."""
    source, dim = token_inputs(node.graph)[str(size.node.expr)]
    with node.graph.inserting_before(node):
        found = node.graph.call_function(torch.ops.aten.sym_size.int, (source, dim))
    found.meta["val"] = size
    return found


def dropout(node: Node, strategy, rank: int, world: int) -> None:
    """A training dropout: this rank's piece of the mask, drawn as Megatron's model-parallel RNG draws it
    (autotp/runtime/dropout.py)."""
    x, p, train = node.args
    if not train or p == 0:
        return
    value = x.meta["val"]
    layout = strategy.output if isinstance(strategy.output, Shard) else None
    size, args = None, (x,)
    if layout is not None:
        size = value.shape[layout.dim]
        if not isinstance(size, int):
            size, args = None, (x, _run_time_size(node, size))
    key = _stream_key(layout, size, rank, world)
    _to_module(node, Dropout(p, layout, size, _memory_order(value), key, rank, world), args)


def attention(node: Node, strategy, rank: int, world: int) -> None:
    """Keys and values repeated per query head passed unrepeated (``grouped_kv``); with dropout_p, this rank's
    heads of the mask, drawn as ``dropout`` draws it."""
    _unrepeat_kv(node)
    bound = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
    if not bound["dropout_p"]:
        return
    heads = full_size(bound["query"], 1)
    layout = strategy.output if isinstance(strategy.output, Shard) else None
    assert layout is None or separate_pieces(layout, heads, world), "attention heads split in overlapping pieces"
    module = Attention(
        bound["dropout_p"],
        bool(bound["is_causal"]),
        bound["scale"],
        bool(bound["enable_gqa"]),
        heads,
        layout,
        _stream_key(layout, heads, rank, world),
        rank,
        world,
    )
    _to_module(node, module, (bound["query"], bound["key"], bound["value"], bound["attn_mask"]))


def _unrepeat_kv(node: Node) -> None:
    """``attention(q, repeat_interleave(k, n, 1), repeat_interleave(v, n, 1))`` without a mask is
    ``attention(q, k, v, enable_gqa=True)`` by enable_gqa's definition: the kernels read each KV head for its n
    query heads without the copies, and keep only k and v for the backward.  A rank's repeat of its heads
    (kernels.repeat_heads) is one when it starts and ends on whole groups."""
    bound = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
    if bound["attn_mask"] is not None or bound["enable_gqa"]:
        return
    found = [_heads_unrepeated(bound[name]) for name in ("key", "value")]
    if None in found or found[0][1] != found[1][1]:
        return
    unrepeated = []
    for source, _, first, count in found:
        if first is None:
            unrepeated.append(source)
            continue
        with node.graph.inserting_before(node):
            narrowed = node.graph.call_function(torch.ops.aten.narrow.default, (source, 1, first, count))
        narrowed.meta = dict(source.meta)  # the full tensor's value, as every node of the program carries
        unrepeated.append(narrowed)
    repeats = [bound[name] for name in ("key", "value")]
    node.args = (bound["query"], *unrepeated)
    node.kwargs = {k: v for k, v in bound.items() if k not in ("query", "key", "value")} | {"enable_gqa": True}
    for repeat in dict.fromkeys(repeats):
        if not repeat.users:
            node.graph.erase_node(repeat)


def _heads_unrepeated(kv) -> tuple | None:
    """(source, repeats, first, count): ``kv`` is ``source`` repeated per head, of ``source``'s heads
    [first, first + count) (first None: all); None if it is not."""
    repeats = heads_repeated(kv)
    if repeats is not None:
        return kv.args[0], repeats, None, None
    if isinstance(kv, Node) and kv.target is kernels.repeat_heads:
        source, repeats, at, in_start, out_start, out_len = kv.args
        if heads_dim(kv, at) and out_start % repeats == 0 and out_len % repeats == 0:
            return source, repeats, out_start // repeats - in_start, out_len // repeats
    return None


def depthwise_groups(node: Node, strategy, rank: int, world: int) -> None:
    """A depthwise conv with its channels split: one group per channel this rank holds."""
    groups = conv_groups(node)
    if groups == 1 or not isinstance(strategy.output, Shard) or strategy.output.dim != 1:
        return
    count = strategy.output.local_size(groups, rank, world)
    if len(node.args) > 6:
        node.args = (*node.args[:6], count)
    else:
        node.kwargs = {**node.kwargs, "groups": count}
