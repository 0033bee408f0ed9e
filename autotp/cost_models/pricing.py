"""What an op costs under a strategy, one place for the TP solver, the pipeline stage splitter and the mesh
planner: seconds (roofline of its FLOPs and the bytes it reads and writes, forward and backward), bytes it
holds (parameters with their training state, KV cache) and bytes its backward keeps, at concrete sizes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import sympy
import torch
from torch.fx import Node

from autotp.cost_models import collective_time, reshard_time
from autotp.cost_models.compute import dequantize_time, op_time, product_time
from autotp.cost_models.memory import state_factor
from autotp.cost_models.topology import Topology
from autotp.ops.keeps import whole_groups
from autotp.ops.strategies import input_slots, is_placed
from autotp.ops.table import flops, is_product, op
from autotp.passes.kept_tensors import element_bytes, kept, kept_gathered
from autotp.passes.recompute import dropped
from autotp.placement import Disjoint, Replicate, Routed, Shard

# Routed rows are not spread evenly: the busiest rank of a dispatch group computes this many times the uniform
# top-k share.  A stated assumption, not a measurement: the capacity factor Switch Transformer trains with (Fedus
# et al. 2021, section 2.2 and table 1: 1.0 to 1.25); dropless dispatch computes every row, so the busiest rank's
# load, not a capacity, sets the time.  PlanOptions.expert_imbalance overrides it.
IMBALANCE = 1.25


@dataclass(frozen=True)
class Experts:
    """How expert segments (ops/expert_segments.py) are priced: ``imbalance`` (the busiest rank's routed rows over
    the uniform share), ``ep`` (a mesh's "ep" ranks every segment is dispatched over, beyond what the TP plan
    does with it) and ``segments`` (node -> its segment, for its nodes, tables and the tables' layout ops)."""

    imbalance: float = IMBALANCE
    ep: int = 1
    segments: Mapping = field(default_factory=dict)

    def share(self, node: Node, placement) -> float:
        """How much of ``node``'s rows a rank computes beyond what ``placement`` over the TP group says: the
        busiest owner's routed rows, or a segment's rows dispatched over the "ep" ranks."""
        if isinstance(placement, Routed):
            return min(1.0, self.imbalance / placement.ranks)
        if self.ep > 1 and node in self.segments and node in self.segments[node].nodes:
            return min(1.0, self.imbalance / self.ep)
        return 1.0

    def held(self, node: Node, placement, world: int) -> float:
        """The largest share of ``node``'s tensor one rank holds: of a table, its experts (dealt over the
        dispatch group, or over the "ep" ranks and then split as the TP plan says); of routed rows, the busiest
        owner's."""
        if node.op != "get_attr":
            return self.share(node, placement) * (
                1.0 if isinstance(placement, Routed) else held_fraction(placement, world)
            )
        dealt = self.ep > 1 and not isinstance(placement, Routed) and node in self.segments
        return held_fraction(placement, world) * (
            _held(Shard(0, units=self.segments[node].experts), self.ep) if dealt else 1.0
        )


class Sizes:
    """Concrete sizes to price the graph at: the example inputs' sizes (pass realistic ones on the
    meta device), with some symbols overridden (``{"s0": 4}``: e.g. the batch of one replica); ``experts``:
    the rows of expert segments a rank computes (they depend on the routing, not on the inputs' sizes)."""

    def __init__(self, overrides: dict | None = None, experts: Experts | None = None):
        self.overrides = overrides or {}
        self.experts = experts or Experts()

    def __call__(self, size) -> int:
        if isinstance(size, int):
            return size
        expr, env = size.node.expr, size.node.shape_env
        return int(expr.xreplace({sym: self.overrides.get(str(sym), _hint(env, sym)) for sym in expr.free_symbols}))

    def numel(self, node: Node) -> float:
        return float(math.prod(self(s) for s in node.meta["val"].shape))

    def nbytes(self, node: Node) -> float:
        v = node.meta.get("val")
        vals = v if isinstance(v, (list, tuple)) else [v]
        return float(
            sum(math.prod(self(s) for s in t.shape) * t.element_size() for t in vals if isinstance(t, torch.Tensor))
        )

    def flops(self, node: Node) -> float:
        """One forward of ``node`` at these sizes (the op table's FLOPs)."""
        return flops(node, self)


def input_sizes(gm: torch.fx.GraphModule, price_at: Mapping) -> dict:
    """Symbol overrides that price ``gm`` at ``price_at`` (input name -> shape, None: the example's size)."""
    inputs = {n.name: n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"}
    inputs = {name: val for name, val in inputs.items() if isinstance(val, torch.Tensor)}
    found: dict = {}
    for name, shape in price_at.items():
        if name not in inputs:
            raise ValueError(
                f"price_at names {name!r}, not a tensor input of the captured model; its tensor inputs: "
                f"{', '.join(inputs) or 'none'}"
            )
        example = inputs[name].shape
        if len(shape) != len(example):
            raise ValueError(
                f"price_at[{name!r}] has {len(shape)} dims, the example input {len(example)}: "
                f"give one size (or None) per dim of {tuple(example)}"
            )
        for d, (want, have) in enumerate(zip(shape, example, strict=True)):
            fixed = have if isinstance(have, int) else int(have.node.expr) if have.node.expr.is_number else None
            if want is None or fixed == want:
                continue
            if isinstance(have, int) or not have.node.expr.is_Symbol:
                raise ValueError(
                    f"price_at[{name!r}] sets dim {d} to {want}, but the capture fixed it at {have}: "
                    "pass an example input of that size, or None for this dim"
                )
            symbol = str(have.node.expr)
            if found.setdefault(symbol, want) != want:
                raise ValueError(f"price_at gives {symbol}, one size of the capture, both {found[symbol]} and {want}")
    return found


def _hint(env, sym) -> int:
    """A symbol's example size; a data-dependent one (rows a mask or a router selects, u0) has none, so it is
    priced at its upper bound where export knows one, else as large as the largest example size: all rows
    selected, the price of the worst case, never a guess below it."""
    if sym in env.backed_var_to_val:
        return env.backed_var_to_val[sym]
    upper = env.var_to_range[sym].upper if sym in env.var_to_range else None
    if isinstance(upper, sympy.Integer) and int(upper) < 2**31:  # int_oo, unbounded, is no sympy.Integer
        return int(upper)
    return max((int(v) for v in env.backed_var_to_val.values()), default=1)


def held_fraction(placement, world: int) -> float:
    """The largest share of a tensor that one rank holds (uneven and grouped shards hold more than 1/N); whole
    experts dealt over a dispatch group, the largest share of the experts."""
    if isinstance(placement, Routed):
        return _held(placement.experts, placement.ranks)
    return _held(placement, world)


def _held(placement, world: int) -> float:
    if not isinstance(placement, Shard):
        return 1.0
    sizes = placement.blocks(1)
    held = [
        sum(
            size * count / placement.parts(world, k)
            for k, (size, (_, count)) in enumerate(zip(sizes, placement.spans(r, world, len(sizes)), strict=True))
        )
        for r in range(world)
    ]
    return max(held) / sum(sizes) if sum(sizes) else 1.0


def shared_fraction(placement: Shard, world: int) -> float:
    """How much of a grouped tensor lies in blocks that several ranks hold (its gradient is summed)."""
    if not placement.chunks:
        return 1.0
    chunks = placement.blocks(1)
    return sum(c for c, shared in zip(chunks, placement.shared_blocks(world), strict=True) if shared) / sum(chunks)


def local_bytes(size: float, placement, world: int) -> float:
    return size * held_fraction(placement, world)


def work_share(node: Node, strategy, world: int, experts: Experts | None = None) -> float:
    """The busiest rank's share of the op's work: routed rows the busiest owner's (``experts``); whole experts
    compute their own rows' products (zeros elsewhere are full size for the other ops); a sharded output its
    share; a partial sum 1/N."""
    out = strategy.output
    first = out[0] if isinstance(out, tuple) and out else out
    share = experts.share(node, first) if experts is not None else 1.0
    if isinstance(out, Disjoint):
        return share * (held_fraction(out.experts, world) if is_product(node) else 1.0)
    if strategy.replicated or isinstance(first, Routed):
        return share
    return share * (held_fraction(out, world) if isinstance(out, Shard) else 1 / world)


def product_shape(node: Node, strategy, sizes: Sizes, world: int) -> tuple:
    """(m, n, k, groups, ragged) of the product one rank computes under ``strategy`` (its operands as it holds
    them), in groups of that shape making its share of the product's FLOPs (whole experts' bmm: its rows)."""
    held_as = dict(zip(input_slots(node), strategy.inputs, strict=True))

    def whole(a: Node) -> list:
        return [sizes(s) for s in a.meta["val"].shape]

    def held(a: Node) -> list:
        dims, placement = whole(a), held_as.get(a)
        if isinstance(placement, Shard):
            dims[placement.dim] *= held_fraction(placement, world)
        return dims

    m, n, k, groups, ragged = op(node.target).shape(node, held, whole)
    shaped = 2.0 * groups * m * n * k
    groups *= sizes.flops(node) * work_share(node, strategy, world, sizes.experts) / shaped if shaped else 1.0
    return m, n, k, groups, ragged


def product_seconds(node: Node, strategy, sizes: Sizes, world: int, topology: Topology, moved: float) -> float:
    """A product at the shape one rank computes, never faster than moving its share of the bytes; a quantized
    one also dequantizes the weight piece it holds (n x k of each group)."""
    m, n, k, groups, ragged = product_shape(node, strategy, sizes, world)
    dequantizes = op(node.target).dequantizes
    dequantized = dequantize_time(dequantizes(node), groups * n * k, m, topology) if dequantizes else 0.0
    share = work_share(node, strategy, world, sizes.experts)
    return product_time(m, n, k, topology, groups, ragged, moved * share, dequantized)


def op_seconds(
    node: Node, strategy, sizes: Sizes, world: int, topology: Topology, training: bool, paired: bool = False
) -> float:
    """Seconds of the op (forward and backward when training); for a parameter held grouped, also the
    all-reduce of its gradient (``paired``: shared with its weight or bias, so without the latency)."""
    row = op(node.target)
    moved = (
        0.0
        if row.view or row.observer
        # a view's output is its input; sizes are metadata
        else (
            row.moves(node, sizes.nbytes)
            if row.moves
            else sizes.nbytes(node) + sum(sizes.nbytes(a) for a in node.all_input_nodes if is_placed(a))
        )
    )
    if node.op != "call_function":
        seconds = 0.0
    elif row.shape is not None:
        seconds = product_seconds(node, strategy, sizes, world, topology, moved)
    else:
        seconds = op_time(sizes.flops(node), moved, topology) * work_share(node, strategy, world, sizes.experts)
    seconds = 3 * seconds if training else seconds  # backward: two products of the forward's shape
    seconds += dispatch_seconds(node, strategy, sizes, topology, training)
    out = strategy.output
    if training and node.op == "get_attr" and isinstance(out, Shard) and out.grouped(world):
        shared = sizes.nbytes(node) * shared_fraction(out, world)
        seconds += collective_time("all_reduce", shared, world, topology)  # summing its gradient
        seconds -= collective_time("all_reduce", 0.0, world, topology) if paired else 0.0
    return seconds


def op_memory(node: Node, strategy, sizes: Sizes, world: int, trainable: dict, training: bool) -> dict:
    """Bytes this node keeps on a device under ``strategy``, by kind."""
    if node.op == "get_attr":
        held = sizes.nbytes(node) * sizes.experts.held(node, strategy.output, world)
        if node.target not in trainable:
            return {"buffers": held}
        state = held * state_factor(node.meta["val"].element_size(), training) - held
        return {"params": held, "grads": held if training else 0.0, "optimizer": state - (held if training else 0)}
    if op(node.target).family == "attention" and not training and "reads_pool" not in op(node.target).tags:
        from autotp.cost_models.kv_memory import attention_memory  # it prices with this module's helpers

        return attention_memory(node, strategy, sizes, world, trainable)
    return {}


def kept_bytes(node: Node, strategy, sizes: Sizes, world: int, grad: set) -> list[tuple]:
    """(key, bytes per device) of each tensor ``node``'s backward keeps; equal keys are one tensor."""
    found = []
    for item in kept(node, strategy, grad):
        share = sizes.experts.held(item.tensor, item.placement, world)
        held = element_bytes(item, sizes.numel(item.tensor)) * share
        if item.kind == "grouped":  # keys or values kept unrepeated where each rank reads whole groups
            repeats = item.tensor.args[1]
            heads = int(item.tensor.meta["val"].shape[1])
            held /= repeats if whole_groups(item.placement, heads, repeats, world) else 1
        found.append(((item.tensor, item.kind, round(share, 9)), held))
    return found


def conversion_seconds(
    have, want, tensor: Node, sizes: Sizes, world: int, topology: Topology, backward: bool = False
) -> float | None:
    """Seconds to convert ``tensor`` from ``have`` to ``want`` (and its gradient back, with ``backward``); None
    where impossible.  Routed rows enter an expert segment at its entry (dispatch: this rank's share of the rows
    to their owners, the row counts first) and leave at its exit (combine: back to their senders, then
    all-gathered by the TP ranks that hold the same tokens); nowhere else."""
    if have == want or not (isinstance(have, Routed) or isinstance(want, Routed)):
        return reshard_time(have, want, sizes.nbytes(tensor), world, topology, backward)
    segment = sizes.experts.segments.get(tensor)
    if isinstance(want, Routed) and isinstance(have, Replicate) and segment is None:  # a row entering
        counts = collective_time("all_to_all", 0.0, want.ranks, topology)  # a few integers: its latency
        return (
            counts
            + _exchange(want, tensor, sizes, world, topology)
            + (_exchange(want, tensor, sizes, world, topology, gather=True) if backward else 0.0)
        )
    if isinstance(have, Routed) and isinstance(want, Replicate) and segment is not None and tensor is segment.exit:
        return _exchange(have, tensor, sizes, world, topology, gather=True) + (
            _exchange(have, tensor, sizes, world, topology) if backward else 0.0
        )
    return None


def _exchange(
    routed: Routed, tensor: Node, sizes: Sizes, world: int, topology: Topology, gather: bool = False
) -> float:
    """One all-to-all of this rank's share of a routed tensor's rows (the busiest receiver's load), then with
    ``gather`` the all-gather of the whole tensor among the ``world`` TP ranks that hold the same tokens."""
    nbytes = sizes.nbytes(tensor)
    seconds = collective_time("all_to_all", nbytes / world * sizes.experts.imbalance, routed.ranks, topology)
    return seconds + (collective_time("all_gather", nbytes, world, topology) if gather else 0.0)


def dispatch_seconds(node: Node, strategy, sizes: Sizes, topology: Topology, training: bool) -> float:
    """A segment dispatched over a mesh's "ep" ranks beyond its TP plan (expert parallelism times expert tensor
    parallelism): priced at its exit, the row counts, each row input's all-to-all and the result's, forward and
    backward.  Routed segments pay theirs at their conversions (conversion_seconds)."""
    experts = sizes.experts
    segment = experts.segments.get(node)
    if experts.ep < 2 or segment is None or node is not segment.exit or isinstance(strategy.output, Routed):
        return 0.0
    inside = set(segment.nodes)
    rows = {
        a
        for n in segment.nodes
        for a in n.all_input_nodes
        if a not in inside and a is not segment.key and a not in experts.segments
    }
    moved = sum(sizes.nbytes(a) for a in rows) + sizes.nbytes(node)
    seconds = collective_time("all_to_all", moved * experts.imbalance, experts.ep, topology)
    seconds += collective_time("all_to_all", 8.0 * segment.experts, experts.ep, topology)
    return seconds * (2 if training else 1)


def regather_time(nbytes: float, world: int, topology: Topology) -> float:
    """A tensor kept as this rank's tokens is all-gathered again when the backward reads it."""
    return collective_time("all_gather", nbytes, world, topology)


def activation_bytes(choice: dict, sizes: Sizes, world: int, grad: set, recomputed=(), regathered=()) -> dict:
    """node -> bytes per device kept for backward of its output's storage (each tensor counted once);
    ``recomputed``: attention cores (passes/recompute.py) that keep nothing of their own; ``regathered``: the
    tokens gathered for an op that the plan keeps as this rank's piece (gathered again in the backward); other
    gathered tokens are kept whole."""
    held: dict = {}
    keepers: dict = {}
    for node, strategy in choice.items():
        for key, nbytes in kept_bytes(node, strategy, sizes, world, grad):
            held[key] = nbytes
            keepers.setdefault(key, set()).add(node)
    gone = set().union(*(dropped(keepers, core) for core in recomputed))
    pieces = kept_gathered(choice, grad) & set(regathered)
    by_node: dict = {}
    for (tensor, kind, share), nbytes in held.items():
        if (tensor, kind, share) in gone:
            continue
        whole = kind == "value" and share == 1.0 and tensor in pieces
        by_node[tensor] = by_node.get(tensor, 0.0) + (nbytes / world if whole else nbytes)
    return by_node


def priced_unit(gm: torch.fx.GraphModule) -> tuple[int, Sizes]:
    """(samples the priced inputs hold, sizes to price at): one sample when the batch dim is symbolic."""
    for node in gm.graph.nodes:
        v = node.meta.get("val")
        if node.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim():
            if isinstance(v.shape[0], int):
                return v.shape[0], Sizes()
            return 1, Sizes({str(v.shape[0].node.expr): 1})
    return 1, Sizes()


def model_flops(gm: torch.fx.GraphModule, sizes: Sizes) -> float:
    """Model FLOPs of one training step at ``sizes``, three times the forward's (Narayanan et al. 2021, no
    recomputation): every product (2 x parameters x tokens for a weight) and attention (4 b a s_q s_k d);
    lookups and elementwise ops are not counted."""
    folding = gm.meta.get("autotp_fold")
    weight = folding.weights.get if folding else (lambda n, d: d)
    return 3 * sum(sizes.flops(n) * weight(n, 1) for n in gm.graph.nodes if is_product(n))


def read_at_both_ends(where: dict) -> set:
    """Weights read both before and after the blocks (``where``: node -> section, passes/fold.sections): tied
    input and output embeddings, of which a pipeline's first and last stages each hold a copy."""
    return {n for n in where if n.op == "get_attr" and {where.get(u) for u in n.users} >= {"pre", "post"}}
