"""Candidates: every node's strategies, what the solver chooses among.

Each node gets the all-replicated strategy, which is always correct, and what the rule of its op table row
proposes (ops/table.py); a parameter is offered only placements every reader takes without moving it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch.fx import Node

from autotp.canonicalize.graph_edits import module_path
from autotp.ops.strategies import Context, Strategy, input_slots, is_placed, replicated_like, value, vmapped
from autotp.passes.capture import target_name, within
from autotp.placement import R, Replicate, Routed, Shard


@dataclass(frozen=True)
class Candidates:
    """What the solver chooses among, on ``world`` ranks."""

    world: int
    strategies: Mapping[Node, list[Strategy]]  # in graph order; the all-replicated one first
    unruled: Mapping[str, str]  # ops on the weights' path without a rule for this use -> why, in a line
    segments: Mapping[Node, Any]  # node -> its expert segment (ops/expert_segments.py)


def enumerate_strategies(gm: torch.fx.GraphModule, ctx: Context) -> Candidates:
    """Every node's strategies: all-replicated, and what its row's rule (``ctx.ops``) proposes (none inside a
    vmap)."""
    weighted = ctx.grad
    unruled: dict[str, str] = {}
    batched = vmapped(gm.graph)
    for node in gm.graph.nodes:
        if node.op in ("output", "call_module") or ctx.op(node.target).observer:
            continue
        if not is_placed(node):
            if node.op == "call_function":  # e.g. item(), mixed tuples: computed from full inputs
                ctx.strategies[node] = [Strategy(ctx.fill(node, {}), None)]
            continue
        all_r = Strategy(ctx.fill(node, {}), replicated_like(node))
        found = [all_r]
        whole = bool(ctx.whole) and within(module_path(node), ctx.whole)  # the user's: not a rule's shortfall
        rule = ctx.op(node.target).rule if node.op == "call_function" and node not in batched else None
        proposed = rule(node, ctx) if rule is not None and not whole else None  # None: no rule for this use
        found += [s for s in proposed or () if s not in found]
        if proposed is None and node.op == "call_function" and node in weighted and not whole:
            unruled.setdefault(target_name(node.target), ctx.why.get(node) or _unruled(node, ctx, batched))
        ctx.strategies[node] = found
    _add_parameter_options(gm, ctx)
    return Candidates(ctx.world, MappingProxyType(dict(ctx.strategies)), MappingProxyType(unruled), ctx.segments)


def _unruled(node: Node, ctx: Context, batched: set[Node]) -> str:
    if node in batched:
        return "computed inside a vmap, where its shapes are one example's"
    if ctx.op(node.target).rule is None:
        return "no sharding rule: computed whole, its inputs gathered"
    return "its rule does not cover this use: computed whole, its inputs gathered"


def _add_parameter_options(gm: torch.fx.GraphModule, ctx: Context) -> None:
    """A parameter is stored in a placement its users compute with (parameters are never gathered).

    Large parameters (at least ``ctx.min_shard_fraction`` of the largest, in ``ctx.parameter_sizes`` where it
    names them) and quantized products' operands must be sharded whenever one shard layout suits every user:
    holding them whole would defeat tensor parallelism.  Small ones (norm weights, output biases) are left to the
    cost model.
    """
    trainable = dict(gm.named_parameters(remove_duplicate=False))
    nodes = [n for n in gm.graph.nodes if n.op == "get_attr" and n in ctx.strategies]
    sizes = {n: ctx.parameter_sizes.get(n.target, value(n).numel()) * value(n).element_size() for n in nodes}
    largest = max((sizes[n] for n in nodes if n.target in trainable), default=0)
    for node in nodes:
        wanted = {R}.union(*(_wanted(node, user, ctx) for user in node.users))
        options: set[Any] = {p for p in wanted if isinstance(p, (Replicate, Shard, Routed))}
        suits_all = {p for p in options if isinstance(p, (Shard, Routed)) and _carried(node, p, ctx, {})}
        large = sizes[node] >= ctx.min_shard_fraction * largest
        if node.target in trainable and suits_all and (large or _quantized(node, ctx)):
            options = suits_all
        if node.target in ctx.fixed:
            options = {ctx.fixed[node.target]}
        ctx.strategies[node] = [Strategy((), p) for p in sorted(options, key=str)]


def _quantized(node: Node, ctx: Context) -> bool:
    """A quantized weight, its scales or zeros: split with its weight wherever one layout suits every reader, so that
    a rank holds only its blocks' scales (ops/quantized_rules.py)."""
    return all("quantized" in ctx.op(user.target).tags for user in node.users)


def _wanted(node: Node, user: Node, ctx: Context) -> set[Any]:
    """The placements of ``node`` that some strategy of ``user`` reads it in."""
    return {
        p
        for strategy in ctx.strategies.get(user, [])
        for slot, p in zip(input_slots(user), strategy.inputs, strict=True)
        if slot is node
    }


def _carried(node: Node, placement: Any, ctx: Context, seen: dict[tuple[Node, Any], bool]) -> bool:
    """Every user of ``node`` can read it in ``placement`` without a collective: a compute op has a strategy
    for it; a layout op (a transpose, a view, an expert's slice ``w[ids]``) has one whose output is carried
    on in turn.  A parameter offered only such shards is never gathered, however many views it passes."""
    key = (node, placement)
    if key not in seen:
        seen[key] = all(
            placement in _wanted(node, user, ctx)
            and (
                not ctx.op(user.target).layout
                or any(
                    _carried(user, s.output, ctx, seen)
                    for s in ctx.strategies.get(user, [])
                    if s.inputs[input_slots(user).index(node)] == placement
                )
            )
            for user in node.users
        )
    return seen[key]
