"""Candidate strategies per node: what each op can do with sharded inputs.

A Strategy fixes the placement of every tensor input slot and of the output.
Rules (passes/rules.py, passes/layout_rules.py) propose the sharded ones; every node also gets the
all-replicated strategy, which is always correct.  The solver picks one each.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch
from torch.fx import Node
from torch.fx.node import map_arg

from autotp.runtime.placement import Partial, R, Replicate, Shard, dealt

# Symbolic sizes are compared by evaluating them at distinct large primes:
# two monomials in batch/sequence symbols agree iff their products agree.
_PRIMES = (1000003, 1000033, 1000037, 1000039, 1000081, 1000099, 1000117, 1000121)


@dataclass(frozen=True)
class Strategy:
    inputs: tuple          # one placement per input slot (None for non-tensor slots)
    output: object         # Placement, tuple of Placements (multi-output op), or None

    @property
    def replicated(self) -> bool:
        def rep(p):
            return p is None or isinstance(p, Replicate) or (isinstance(p, tuple) and all(map(rep, p)))
        return rep(self.output) and all(map(rep, self.inputs))


ADDITIVE = {torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor}


def adds_once(node: Node, strategy: Strategy) -> bool:
    """A partial sum plus (or minus) a replicated operand -- a bias, the residual stream -- stays a
    partial sum when one rank adds that operand (passes/rewrite.py); the others add zeros."""
    return (node.target in ADDITIVE and isinstance(strategy.output, Partial)
            and any(isinstance(p, Replicate) for p in strategy.inputs))


def partial_grad(node: Node, strategy: Strategy, want) -> bool:
    """Whether an input that ``strategy`` reads replicated (``want``) gets back only this rank's share
    of its gradient, which a backward all-reduce must sum (Megatron's f).  An operand added once to a
    partial sum does not: the gradient arriving at a partial sum is whole on every rank (the forward
    all-reduce's backward is the identity), and it passes to the operand unchanged."""
    return isinstance(want, Replicate) and not strategy.replicated and not adds_once(node, strategy)


_PRODUCTS = {torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.matmul.default}
_TRANSPOSES = {torch.ops.aten.t.default, torch.ops.aten.numpy_T.default, torch.ops.aten.transpose.int}


def bias_weights(gm: torch.fx.GraphModule) -> dict:
    """bias parameter node -> the weight parameter node of the product it is added to (``linear(x, w) + b``,
    ``x @ w.t() + b``): where ranks share rows of both (a multi-query projection's K and V), one
    backward all-reduce sums both gradients."""
    found: dict = {}
    for node in gm.graph.nodes:
        if node.target not in ADDITIVE or len(node.args) < 2 or not isinstance(node.args[1], Node):
            continue
        product, bias = node.args[:2]
        if bias.op != "get_attr" or not isinstance(product, Node) or product.target not in _PRODUCTS:
            continue
        weight = product.args[1]
        while isinstance(weight, Node) and weight.target in _TRANSPOSES:
            weight = weight.args[0]
        if isinstance(weight, Node) and weight.op == "get_attr" and weight is not bias:
            found[bias] = weight if found.get(bias, weight) is weight else None  # one weight, or none
    return {bias: weight for bias, weight in found.items() if weight is not None}


def gradient_sums(gm: torch.fx.GraphModule, choice: dict, world: int) -> list:
    """The trainable parameters whose gradients ranks sum (held grouped), one list per all-reduce: a bias
    goes with the weight of its product when both are grouped (bias_weights)."""
    trainable = {name for name, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}
    grouped = {n: None for n in gm.graph.nodes if n.op == "get_attr" and n in choice and n.target in trainable
               and isinstance(choice[n].output, Shard) and choice[n].output.grouped(world)}
    partner = {weight: bias for bias, weight in bias_weights(gm).items() if bias in grouped and weight in grouped}
    paired = set(partner.values())
    return [[n, partner[n]] if n in partner else [n] for n in grouped if n not in paired]


def coalesced(src: Node) -> bool:
    """A replicated parameter (of at least one dim) whose gradients, partial where sharded ops read it, are summed
    in one backward all-reduce with the others of its dtype (Megatron-SP's norm weights): see partial_params."""
    return src.op == "get_attr" and isinstance(value(src), torch.Tensor) and value(src).dim() > 0


def partial_params(gm: torch.fx.GraphModule, choice: dict, grad: set) -> list:
    """Lists of replicated parameters (graph order, one list per dtype) that some sharded op reads: each rank
    holds part of their gradients (a norm's weight under sequence parallelism), summed by one all-reduce."""
    read = {src for node, strategy in choice.items() for src, want in zip(input_slots(node), strategy.inputs,
                                                                          strict=True)
            if src in grad and coalesced(src) and partial_grad(node, strategy, want)}
    found: dict = {}
    for node in gm.graph.nodes:
        if node in read:
            found.setdefault(value(node).dtype, []).append(node)
    return list(found.values())


def input_slots(node: Node) -> list[Node]:
    """The node's inputs in the order map_arg visits them; the rewriter relies on the same order."""
    slots: list[Node] = []
    map_arg((node.args, node.kwargs), lambda n: slots.append(n) or n)
    return slots


def contractible(options, dim: int, world: int) -> list[Shard]:
    """Shards of a contracted dim whose partial products sum to the full one: each element is held
    by exactly one rank (not grouped), and not block-wise (the other operand cannot follow)."""
    found = [p for p in options if isinstance(p, Shard) and p.dim == dim and p.chunks is None and not p.grouped(world)]
    return list(dict.fromkeys(found))


def concrete(size):
    """``size`` as an int if it has one value (a SymInt whose expression is a number), else unchanged."""
    if isinstance(size, torch.SymInt) and size.node.expr.is_number:
        return int(size)
    return size


def value(node: Node):
    return node.meta.get("val")


def is_placed(node: Node) -> bool:
    """Tensors (and lists of tensors) have placements; sizes, flags and None do not."""
    v = value(node)
    if isinstance(v, (list, tuple)):
        return len(v) > 0 and all(isinstance(x, torch.Tensor) for x in v)
    return isinstance(v, torch.Tensor)


def replicated_like(node: Node):
    v = value(node)
    if not is_placed(node):
        return None
    return tuple(R for _ in v) if isinstance(v, (list, tuple)) else R


@dataclass
class Context:
    """What rules may ask about the graph: shapes, the world size, fused-block hints."""
    world: int
    hints: dict = field(default_factory=dict)        # (node, dim) -> set of chunk tuples
    units: dict = field(default_factory=dict)        # (node, dim) -> unit counts (heads) seen downstream
    block_units: dict = field(default_factory=dict)  # (node, dim) -> {(chunks, units per block)} of fused dims
    covers: dict = field(default_factory=dict)       # KV heads -> {query heads} they are repeated to
    strategies: dict = field(default_factory=dict)   # node -> list[Strategy], filled in order
    min_shard_fraction: float = 0.02                 # parameters this large (vs the largest) must shard
    unruled: set = field(default_factory=set)        # ops on the weights' path that have no rule
    fixed: dict = field(default_factory=dict)        # parameter name -> placement imposed (to price other plans)
    tokens: bool = False                             # offer sequence parallelism (token_options)
    token_symbols: set = field(default_factory=set)  # sizes of token dims: inputs' symbolic non-leading dims
    grad: set = field(default_factory=set)           # values on the weights' path (gradients flow)
    experts: str | None = None                       # impose "tensor" or "parallel" experts (expert_rules.py)
    routes: dict = field(default_factory=dict)       # node -> what routed its rows to experts, once
    _probes: dict = field(default_factory=dict)
    _options: dict = field(default_factory=dict)     # shard_options, once per (node, dim): hints are fixed by then

    def shape(self, node) -> tuple:
        """Sizes as ints where they are fixed, even where export left them as constant SymInts (a dim
        of an input it specialized: a ViT's image size, hence its number of patches)."""
        v = value(node) if isinstance(node, Node) else None
        return tuple(map(concrete, v.shape)) if isinstance(v, torch.Tensor) else ()

    def static(self, size) -> bool:
        return isinstance(size, int)

    def probe(self, size) -> int:
        """A number that identifies a (possibly symbolic) size for equality tests."""
        if isinstance(size, int):
            return size
        expr = size.node.expr
        subs = {}
        for sym in sorted(expr.free_symbols, key=str):
            subs[sym] = self._probes.setdefault(str(sym), _PRIMES[len(self._probes) % len(_PRIMES)])
        return int(sympy.sympify(expr).subs(subs))

    def shard_options(self, node: Node, dim: int) -> list[Shard]:
        """Ways to shard ``dim`` of ``node``'s output: N equal slices; whole units (heads: uneven, or
        shared by several ranks when there are fewer than N); the KV heads that each rank's query heads
        need (``of``); block by block for fused outputs, each block by its own units.  Options that
        deal out the same pieces as an earlier one are left out (one spelling per layout)."""
        if (node, dim) not in self._options:
            self._options[(node, dim)] = self._shard_options(node, dim)
        return self._options[(node, dim)]

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
            options += [Shard(dim, units=units, of=finer) for finer in sorted(self.covers.get(units, ()))
                        if finer >= self.world or self.world % finer == 0]
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

    def on_tokens(self, node: Node, strategy) -> bool:
        """Whether ``strategy`` keeps ``node``'s output split along a token dim."""
        out = strategy.output
        return isinstance(out, Shard) and out.dim < len(self.shape(node)) and not self.static(self.shape(node)[out.dim])

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


def is_observer(node: Node) -> bool:
    """Ops that only read metadata of unsharded dims: they adopt any placement and need no choice."""
    return node.op == "call_module" or node.target in (
        torch.ops.aten.sym_size.int, torch.ops.aten._assert_tensor_metadata.default,
    )


_aten = torch.ops.aten
# ops whose output is the same data as their first input, seen another way (or a cast of it): a parameter
# seen through them is still the parameter, and is never gathered either (no weight travels at run time)
LAYOUT_OPS = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.permute.default,
              _aten.t.default, _aten.numpy_T.default, _aten.transpose.int, _aten.unsqueeze.default,
              _aten.squeeze.dim, _aten.expand.default, _aten.slice.Tensor, _aten.select.int, _aten.alias.default,
              _aten.detach.default, _aten.index.Tensor, _aten.to.dtype, _aten._to_copy.default}


def stored_views(gm: torch.fx.GraphModule) -> set:
    """Parameters and buffers, and what layout ops make of them (``w.transpose(-2, -1)``, ``w[expert_ids]``)."""
    found: set = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr" or (node.target in LAYOUT_OPS and node.args and node.args[0] in found):
            found.add(node)
    return found


def needs_grad(gm: torch.fx.GraphModule) -> set:
    """Nodes whose value depends on a trainable parameter (their gradients flow); integer values (expert
    ids sorted by a router's scores) have none."""
    params = {name for name, p in gm.named_parameters() if p.requires_grad}
    grad: set = set()
    for node in gm.graph.nodes:
        v = value(node)
        if isinstance(v, torch.Tensor) and not (v.is_floating_point() or v.is_complex()):
            continue
        if (node.op == "get_attr" and node.target in params) or any(a in grad for a in node.all_input_nodes):
            grad.add(node)
    return grad


def token_symbols(gm: torch.fx.GraphModule) -> set:
    """Names of the symbols that size the inputs' dims after the first (batch): the sequence."""
    found = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" and isinstance(value(node), torch.Tensor):
            found |= {str(s.node.expr) for s in value(node).shape[1:]
                      if isinstance(s, torch.SymInt) and s.node.expr.is_Symbol}
    return found


def rule_of(rules: dict, target):
    """The rule for an op; other libraries' custom ops are keyed by name (they exist once imported)."""
    return rules.get(target) or rules.get(str(target))


def enumerate_strategies(gm: torch.fx.GraphModule, ctx: Context, rules: dict,
                         more_rules: dict | None = None) -> Context:
    """Every node's strategies: all-replicated, what its rule proposes, and what ``more_rules`` add to it."""
    weighted = needs_grad(gm)
    ctx.grad, ctx.token_symbols = weighted, token_symbols(gm)
    for node in gm.graph.nodes:
        if node.op == "output" or is_observer(node):
            continue
        if not is_placed(node):
            if node.op == "call_function":  # e.g. item(), mixed tuples: computed from full inputs
                ctx.strategies[node] = [Strategy(ctx.fill(node, {}), None)]
            continue
        all_r = Strategy(ctx.fill(node, {}), replicated_like(node))
        found = [all_r]
        rule = rule_of(rules, node.target) if node.op == "call_function" else None
        proposed = rule(node, ctx) if rule is not None else None  # None: no rule for this use of the op
        more = rule_of(more_rules or {}, node.target) if node.op == "call_function" else None
        added = more(node, ctx) if more is not None else []
        proposed = proposed if not added else [*(proposed or ()), *added]
        found += [s for s in proposed or () if s not in found]
        if proposed is None and node.op == "call_function" and node in weighted:
            ctx.unruled.add(str(node.target))
        ctx.strategies[node] = found
    _add_parameter_options(gm, ctx)
    return ctx


def _add_parameter_options(gm: torch.fx.GraphModule, ctx: Context) -> None:
    """A parameter is stored in a placement its users compute with (parameters are never gathered).

    Large parameters (at least ``ctx.min_shard_fraction`` of the largest) must be sharded whenever
    one shard layout suits every user: holding them whole would defeat tensor parallelism.  Small
    ones (norm weights, output biases) are left to the cost model.
    """
    trainable = dict(gm.named_parameters(remove_duplicate=False))
    nodes = [n for n in gm.graph.nodes if n.op == "get_attr" and n in ctx.strategies]
    sizes = {n: value(n).numel() * value(n).element_size() for n in nodes}
    largest = max((sizes[n] for n in nodes if n.target in trainable), default=0)
    for node in nodes:
        wanted = {R}.union(*(_wanted(node, user, ctx) for user in node.users))
        options = {p for p in wanted if isinstance(p, (Replicate, Shard))}
        suits_all = {p for p in options if isinstance(p, Shard) and _carried(node, p, ctx, {})}
        if node.target in trainable and suits_all and sizes[node] >= ctx.min_shard_fraction * largest:
            options = suits_all
        if node.target in ctx.fixed:
            options = {ctx.fixed[node.target]}
        ctx.strategies[node] = [Strategy((), p) for p in sorted(options, key=str)]


def _wanted(node: Node, user: Node, ctx: Context) -> set:
    """The placements of ``node`` that some strategy of ``user`` reads it in."""
    return {p for strategy in ctx.strategies.get(user, [])
            for slot, p in zip(input_slots(user), strategy.inputs, strict=True) if slot is node}


def _carried(node: Node, placement, ctx: Context, seen: dict) -> bool:
    """Every user of ``node`` can read it in ``placement`` without a collective: a compute op has a strategy
    for it; a layout op (a transpose, a view, an expert's slice ``w[ids]``) has one whose output is carried
    on in turn.  A parameter offered only such shards is never gathered, however many views it passes."""
    key = (node, placement)
    if key not in seen:
        seen[key] = all(placement in _wanted(node, user, ctx) and (user.target not in LAYOUT_OPS or any(
            _carried(user, s.output, ctx, seen) for s in ctx.strategies.get(user, [])
            if s.inputs[input_slots(user).index(node)] == placement)) for user in node.users)
    return seen[key]
