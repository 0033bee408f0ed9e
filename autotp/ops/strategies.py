"""Candidate strategies per node: what each op can do with sharded inputs.

A Strategy fixes the placement of every tensor input slot and of the output.
Rules (the op table, ops/table.py) propose the sharded ones; every node also gets the all-replicated
strategy, which is always correct.  The solver picks one each.  Rules read other ops' rows through
``Context.op`` (the table sits above the rule modules, which it names).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import sympy
import torch
from torch.fx import Node
from torch.fx.node import map_arg

from autotp.ops.semantics import Op, row_of
from autotp.placement import R, Replicate, Shard, dealt

# Symbolic sizes are compared by evaluating them at distinct large primes:
# two monomials in batch/sequence symbols agree iff their products agree.
_PRIMES = (1000003, 1000033, 1000037, 1000039, 1000081, 1000099, 1000117, 1000121)


@dataclass(frozen=True)
class Strategy:
    inputs: tuple  # one placement per input slot (None for non-tensor slots)
    output: object  # Placement, tuple of Placements (multi-output op), or None

    @property
    def replicated(self) -> bool:
        def rep(p):
            return p is None or isinstance(p, Replicate) or (isinstance(p, tuple) and all(map(rep, p)))

        return rep(self.output) and all(map(rep, self.inputs))


def input_slots(node: Node) -> list[Node]:
    """The node's inputs in the order map_arg visits them; the rewriter relies on the same order."""
    slots: list[Node] = []
    map_arg((node.args, node.kwargs), lambda n: slots.append(n) or n)
    return slots


def contractible(options, dim: int, world: int, blocks: bool = False) -> list[Shard]:
    """Shards of a contracted dim whose partial products sum to the full one: each element is held
    by exactly one rank (not grouped), and not block-wise unless ``blocks`` (a weight follows any layout of its
    input's features: ConvBERT's two kinds of heads joined before the output projection; an activation may not)."""
    found = [
        p
        for p in options
        if isinstance(p, Shard)
        and p.dim == dim
        and not p.grouped(world)
        and (p.chunks is None or (blocks and p.of is None and p.groups is None))
    ]
    return list(dict.fromkeys(found))


def concrete(size):
    """``size`` as an int if it has one value (a SymInt whose expression is a number), else unchanged."""
    if isinstance(size, torch.SymInt) and size.node.expr.is_number:
        return int(size)
    return size


def value(node: Node):
    return node.meta.get("val")


def shape(node) -> tuple:
    """Sizes as ints where they are fixed, even where export left them as constant SymInts (a dim of an input
    it specialized: a ViT's image size, hence its number of patches); symbolic sizes stay SymInts."""
    v = value(node) if isinstance(node, Node) else None
    return tuple(map(concrete, v.shape)) if isinstance(v, torch.Tensor) else ()


def on_tokens(node: Node, strategy) -> bool:
    """Whether ``strategy`` keeps ``node``'s output split along a token dim (a size that is not fixed)."""
    out = strategy.output
    sizes = shape(node)
    return isinstance(out, Shard) and out.dim < len(sizes) and not isinstance(sizes[out.dim], int)


def token_inputs(graph: torch.fx.Graph) -> dict:
    """Token sizes and where to read them: the name of each symbol that sizes an input's dim after the first
    (batch) -> (that input, the dim).  Sequence parallelism splits these dims; the rewrite reads their full
    length off the input at run time."""
    found: dict = {}
    for node in graph.nodes:
        if node.op == "placeholder" and isinstance(value(node), torch.Tensor):
            for d, s in enumerate(value(node).shape):
                if d and isinstance(s, torch.SymInt) and s.node.expr.is_Symbol:
                    found.setdefault(str(s.node.expr), (node, d))
    return found


def is_placed(node: Node) -> bool:
    """Tensors (and lists of tensors) have placements; sizes, flags and None do not."""
    v = value(node)
    if isinstance(v, (list, tuple)):
        return len(v) > 0 and all(isinstance(x, torch.Tensor) for x in v)
    return isinstance(v, torch.Tensor)


def summable(node: Node) -> bool:
    """A value that may be held as a partial sum: numbers, not booleans (a mask is no sum of parts)."""
    v = value(node)
    return isinstance(v, torch.Tensor) and v.dtype != torch.bool


def replicated_like(node: Node):
    v = value(node)
    if not is_placed(node):
        return None
    return tuple(R for _ in v) if isinstance(v, (list, tuple)) else R


class Notes:
    """What rules record while strategies are enumerated: each node's strategies so far (rules read their inputs'),
    why a rule offered no split, which op routed rows to experts, and memos (probe primes, shard options)."""

    def __init__(self):
        self.strategies: dict = {}  # node -> list[Strategy], filled in graph order
        self.why: dict = {}  # node -> why its rule offers no split (a rule that says)
        self.routes: dict = {}  # node -> what routed its rows to experts, once
        self.probes: dict = {}  # symbol -> the prime it is evaluated at
        self.options: dict = {}  # (node, dim) -> shard_options, once: hints are fixed by then


@dataclass(frozen=True)
class Context:
    """What rules may ask about the graph: the world size, the analysis of the graph (hints, expert segments,
    gradients), the planning options that shape the offer, and the op table.  Built once per solve
    (planning/analysis.analyse); only ``notes`` is written, by the enumeration the rules take part in."""

    world: int
    hints: Mapping = field(default_factory=dict)  # (node, dim) -> set of chunk tuples
    units: Mapping = field(default_factory=dict)  # (node, dim) -> unit counts (heads) seen downstream
    block_units: Mapping = field(default_factory=dict)  # (node, dim) -> {(chunks, units per block)} of fused dims
    covers: Mapping = field(default_factory=dict)  # KV heads -> {query heads} they are repeated to
    segments: Mapping = field(default_factory=dict)  # node -> its expert segment (ops/expert_segments.py)
    grad: frozenset = frozenset()  # values on the weights' path (gradients flow)
    token_symbols: frozenset = frozenset()  # sizes of token dims: inputs' symbolic non-leading dims
    min_shard_fraction: float = 0.02  # parameters this large (vs the largest) must shard
    parameter_sizes: Mapping = field(default_factory=dict)  # name -> elements the fraction compares (else its own)
    fixed: Mapping = field(default_factory=dict)  # parameter name -> placement imposed (to price other plans)
    whole: frozenset = frozenset()  # modules every op of which computes whole (options.fixed)
    tokens: bool = False  # offer sequence parallelism (token_options)
    experts: str | None = None  # impose "tensor", "parallel" or "all-to-all" (expert_rules)
    ep: int = 1  # a mesh's "ep" ranks the expert segments are dispatched over
    ops: Mapping = field(default_factory=dict)  # the op table (ops/table.py): target -> Op
    notes: Notes = field(default_factory=Notes, compare=False)

    @property
    def strategies(self) -> dict:
        return self.notes.strategies

    @property
    def why(self) -> dict:
        return self.notes.why

    @property
    def routes(self) -> dict:
        return self.notes.routes

    def op(self, target) -> Op:
        """What the op table says of ``target`` (an empty row for ops it does not know)."""
        return row_of(self.ops, target)

    def shape(self, node) -> tuple:
        return shape(node)

    def static(self, size) -> bool:
        return isinstance(size, int)

    def probe(self, size) -> int:
        """A number that identifies a (possibly symbolic) size for equality tests."""
        if isinstance(size, int):
            return size
        expr = size.node.expr
        subs = {}
        for sym in sorted(expr.free_symbols, key=str):
            subs[sym] = self.notes.probes.setdefault(str(sym), _PRIMES[len(self.notes.probes) % len(_PRIMES)])
        return int(sympy.sympify(expr).subs(subs))

    def shard_options(self, node: Node, dim: int) -> list[Shard]:
        """Ways to shard ``dim`` of ``node``'s output: N equal slices; whole units (heads: uneven, or
        shared by several ranks when there are fewer than N); the KV heads that each rank's query heads
        need (``of``); block by block for fused outputs, each block by its own units.  Options that
        deal out the same pieces as an earlier one are left out (one spelling per layout)."""
        if (node, dim) not in self.notes.options:
            self.notes.options[(node, dim)] = self._shard_options(node, dim)
        return self.notes.options[(node, dim)]

    def _shard_options(self, node: Node, dim: int) -> list[Shard]:
        shape = self.shape(node)
        size = shape[dim] if dim < len(shape) else None
        if self.world < 2 or not self.static(size) or size < 2:
            return []  # dynamic dims (batch, sequence) are never sharded
        options = [Shard(dim)] if size % self.world == 0 else []
        whole = {1} if 1 in self.covers else set()  # single KV heads repeated: any dim may be held whole
        for units in sorted({size} | self.units.get((node, dim), set()) | whole):
            if size % units:
                continue
            if dealt(units, self.world):
                options.append(Shard(dim, units=units))
            if units == 1:
                options.append(Shard(dim, units=1))  # whole: every rank holds it (its gradient: partial sums)
                continue
            options += [
                Shard(dim, units=units, of=finer)
                for finer in sorted(self.covers.get(units, ()))
                if finer >= self.world or self.world % finer == 0
            ]
        for chunks in sorted(self.hints.get((node, dim), ())):
            if all(c % self.world == 0 for c in chunks):
                options.append(Shard(dim, chunks))
        for chunks, units, *grouping in sorted(self.block_units.get((node, dim), ())):
            if not grouping:
                options += [Shard(dim, chunks, units, of) for of in self._finer(units)]
            elif sum(chunks) * grouping[1] == size and (grouping[0] >= self.world or self.world % grouping[0] == 0):
                options.append(Shard(dim, chunks, units, *grouping))  # the blocks of one group, repeated
        seen, found = set(), []
        for option in options:
            layout = tuple(tuple(option.ranges(size, r, self.world)) for r in range(self.world))
            if layout not in seen:
                seen.add(layout)
                found.append(option)
        return found

    def token_options(self, node: Node, dim: int) -> list[Shard]:
        """Sequence parallelism: a token dim (an input's symbolic dim after the first, e.g. the sequence) of
        a value on the weights' path, in contiguous pieces, uneven when need be (11 tokens on 4 ranks:
        3,3,3,2).  Only rules whose ops need no size arguments offer it (pointwise, norms, reductions)."""
        shape = self.shape(node)
        if not self.tokens or self.world < 2 or node not in self.grad or dim >= len(shape):
            return []
        size = shape[dim]
        return [Shard(dim)] if isinstance(size, torch.SymInt) and str(size.node.expr) in self.token_symbols else []

    def _finer(self, units: tuple) -> list:
        """The query-head counts the blocks' units may follow (None: each block dealt out on its own)."""

        def valid(of):
            if of is None:
                return all(u == 1 or u % self.world == 0 or dealt(u, self.world) for u in units)
            return (of >= self.world or self.world % of == 0) and all(of % u == 0 for u in units)

        return [of for of in [None, *sorted(set().union(*(self.covers.get(u, ()) for u in units)))] if valid(of)]

    def fill(self, node: Node, placements: dict) -> tuple:
        """Input placements by slot: given ones from ``placements``, R for other tensors."""
        return tuple(placements.get(s, replicated_like(s)) if is_placed(s) else None for s in input_slots(node))

    def output_options(self, node: Node) -> list:
        return list(dict.fromkeys(s.output for s in self.strategies.get(node, [])))


def needs_grad(gm: torch.fx.GraphModule) -> set:
    """Nodes whose value depends on a trainable parameter (their gradients flow); integer values (expert
    ids sorted by a router's scores) have none."""
    params = {name for name, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}
    grad: set = set()
    for node in gm.graph.nodes:
        v = value(node)
        if isinstance(v, torch.Tensor) and not (v.is_floating_point() or v.is_complex()):
            continue
        if (node.op == "get_attr" and node.target in params) or any(a in grad for a in node.all_input_nodes):
            grad.add(node)
    return grad


def vmapped(graph: torch.fx.Graph) -> set:
    """Nodes computed inside a vmap (create_block_mask's mask function, traced batched): their shapes are one
    example's, the vmapped dims hidden, so no rule may split them.  Tracked by the vmap levels a value carries."""
    levels: dict = {}
    for node in graph.nodes:
        held = set().union(*(levels.get(a, set()) for a in node.all_input_nodes))
        name = getattr(node.target, "__name__", "") if getattr(node.target, "__module__", "") == _VMAP else ""
        if name == "_add_batch_dim":
            held = held | {node.args[2]}
        elif name == "_remove_batch_dim":
            held = held - {node.args[1]}
        if held:
            levels[node] = held
    return set(levels)


_VMAP = "torch._functorch.predispatch"
