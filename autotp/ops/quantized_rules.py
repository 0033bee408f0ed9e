"""The quantized linears' rule: Megatron's column and row splits, offered only where every cut falls between whole
blocks, groups and packed int32 words, with each scale (and packed zero) split as its weight is.

A quantized product is read from its spec (``QUANTIZED``, by op): which operands hold the output
dim and which the contracted one, each with how many weight elements one of its elements stands for (a block's
scale, a packed word).  A dim that is not whole blocks a rank is split by whole blocks unevenly (13 blocks over 4
ranks: 4, 3, 3, 3), as heads are, or left whole: the planner prices both (passes/hints.py offers the block counts
to the ops around it).  A piece cut so is a quantized weight of its own, so the local op is the same op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch.fx import Node

from autotp.ops.strategies import Context, Strategy, contractible
from autotp.placement import P, Shard, dealt
from autotp.runtime import quantized_ops  # noqa: F401  (registers torch.ops.autotp's quantized products)


@dataclass(frozen=True)
class QuantizedSpec:
    """Per operand slot: (slot, dim, elements of the weight's dim per element) for the output dim (``outputs``)
    and the contracted dim (``inputs``); ``ops``: the operations dequantizing one weight element takes, one per
    elementwise step of its dequantization as runtime/quantized_ops.py writes it (the cost model's figure)."""

    outputs: tuple[tuple[int, int, int], ...]
    inputs: tuple[tuple[int, int, int], ...]
    ops: int


def fp8_spec(node: Node) -> QuantizedSpec:
    """fp8_block_linear(x, weight[N, K], scale_inv[N/bn, K/bk], bn, bk); dequantized: to float, times the scale,
    to the activation's dtype."""
    bn, bk = node.args[3], node.args[4]
    return QuantizedSpec(outputs=((1, 0, 1), (2, 0, bn)), inputs=((1, 1, 1), (2, 1, bk)), ops=3)


def int4_spec(node: Node) -> QuantizedSpec:
    """int4_group_linear(x, qweight[K/8, N], scales[K/g, N], qzeros[K/g, N/8], g): 8 values a word; dequantized:
    shifted, masked, to float, less the zero, times the scale, to the activation's dtype."""
    group = node.args[4]
    return QuantizedSpec(
        outputs=((1, 1, 1), (2, 1, 1), (3, 1, 8)), inputs=((1, 0, 8), (2, 0, group), (3, 0, group)), ops=6
    )


def granule(pieces: tuple[tuple[int, int, int], ...]) -> int:
    """The dim's indivisible piece: a block, a group, a packed word (their least common multiple)."""
    return math.lcm(*(per for _, _, per in pieces))


def follow(shard: Shard, size: int, per: int, dim: int, world: int) -> Shard | None:
    """How an operand whose element stands for ``per`` elements of a dim of ``size`` is split when that dim is
    split as ``shard``; None where some cut falls inside one of its elements (a block, a group, a packed word)."""
    if per == 1:
        return shard.at(dim)
    chunks = shard.chunks
    if chunks is not None and any(c % per for c in chunks):
        return None
    moved = replace(shard, dim=dim, chunks=None if chunks is None else tuple(c // per for c in chunks))
    length = math.ceil(size / per)
    for rank in range(world):
        found = []
        for start, n in shard.ranges(size, rank, world):
            end = start + n
            if start % per or (end % per and end != size):
                return None
            found.append((start // per, math.ceil(end / per) - start // per))
        if found != moved.ranges(length, rank, world):
            return None
    return moved


def _pieces(node: Node, shard: Shard, pieces, size: int, ctx: Context) -> dict | None:
    placed = {}
    for slot, dim, per in pieces:
        followed = follow(shard, size, per, dim, ctx.world)
        if followed is None:
            return None
        placed[node.args[slot]] = followed
    return placed


def _with_blocks(options: list, dim: int, size, unit: int, world: int) -> list:
    """``options`` and the split by whole granules (uneven where they are not a multiple of the ranks)."""
    if isinstance(size, int) and size % unit == 0 and dealt(size // unit, world):
        return [*options, Shard(dim, units=size // unit)]
    return options


def quantized_linear(node: Node, ctx: Context) -> list[Strategy]:
    """Column split (output features, whole blocks), row split (input features, whole blocks: partial sums), a
    partial input (partial sums), or rows of the input."""
    spec: QuantizedSpec = QUANTIZED[node.target](node)
    x = node.args[0]
    out = ctx.shape(node)
    last, xlast = len(out) - 1, len(ctx.shape(x)) - 1
    found = []
    columns = _with_blocks(ctx.shard_options(node, last), last, out[last], granule(spec.outputs), ctx.world)
    for s in dict.fromkeys(columns):
        placed = _pieces(node, s, spec.outputs, out[last], ctx)
        if placed is not None:
            found.append(Strategy(ctx.fill(node, placed), s))
    k = ctx.shape(x)[xlast]
    rows = _with_blocks(ctx.output_options(x) + ctx.shard_options(x, xlast), xlast, k, granule(spec.inputs), ctx.world)
    for s in contractible(rows, xlast, ctx.world):
        placed = _pieces(node, s, spec.inputs, k, ctx)
        if placed is not None:
            found.append(Strategy(ctx.fill(node, {x: s, **placed}), P))
    found.append(Strategy(ctx.fill(node, {x: P}), P))
    for d in range(last):
        found += [Strategy(ctx.fill(node, {x: s}), s) for s in ctx.shard_options(node, d) if s.chunks is None]
    return found


def block_units(node: Node, ctx: Context) -> list:
    """(input, its last dim, its whole granules): hints for the ops before a quantized product, so that they offer
    the split by whole blocks its row split reads (passes/hints.py)."""
    x = node.args[0]
    spec: QuantizedSpec = QUANTIZED[node.target](node)
    k, unit = ctx.shape(x)[-1], granule(spec.inputs)
    return [(x, len(ctx.shape(x)) - 1, k // unit)] if isinstance(k, int) and k % unit == 0 and k > unit else []


def quantized_shape(node: Node, held, whole) -> tuple:
    """x[..., k] times the weight's output features (the weight operand's output dim)."""
    x = held(node.args[0])
    spec: QuantizedSpec = QUANTIZED[node.target](node)
    slot, dim, _ = spec.outputs[0]
    return math.prod(x[:-1]), held(node.args[slot])[dim], x[-1], 1, False


def dequantize_ops(node: Node) -> int:
    """Operations per weight element of dequantizing this product's weight (the op-table row's ``dequantizes``)."""
    return QUANTIZED[node.target](node).ops


QUANTIZED = {
    torch.ops.autotp.fp8_block_linear.default: fp8_spec,
    torch.ops.autotp.int4_group_linear.default: int4_spec,
}


def quantized_layout(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Parameter name -> how it is stored, for each operand of a quantized product (the plan JSON records it and
    ``autotp plan`` shows it): a weight's format and the blocks or groups no split falls inside; its scales and
    zeros as "the ... of" it."""
    found = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in QUANTIZED:
            continue
        names = [a.target if isinstance(a, Node) and a.op == "get_attr" else None for a in node.args]
        weight = names[1]
        if node.target == torch.ops.autotp.fp8_block_linear.default:
            blocks = f"{node.args[3]}x{node.args[4]} blocks"
            described = {1: f"fp8 e4m3 in {blocks}", 2: f"the float32 scales of {weight}'s {blocks}"}
        else:
            group = f"groups of {node.args[4]} inputs"
            described = {
                1: f"gptq int4, 8 a word along inputs, in {group}",
                2: f"the float16 scales of {weight}'s {group}",
                3: f"the int4 zeros (stored one less, 8 a word along outputs) of {weight}'s {group}",
            }
        found.update({names[slot]: text for slot, text in described.items() if names[slot] is not None})
    return found
