"""Which gradients ranks sum: a parameter's where ranks hold parts of it (units shared by several ranks, a
bias with its weight), a replicated input's where sharded ops read it (Megatron's f), and none for an operand
that one rank adds to a partial sum."""

from __future__ import annotations

import torch
from torch.fx import Node

from autotp.ops.strategies import Strategy, input_slots, value
from autotp.ops.table import op
from autotp.placement import Partial, Replicate, Shard


def adds_once(node: Node, strategy: Strategy) -> bool:
    """A partial sum plus (or minus) a replicated operand -- a bias, the residual stream -- stays a
    partial sum when one rank adds that operand (passes/rewrite.py); the others add zeros."""
    return (
        op(node.target).additive
        and isinstance(strategy.output, Partial)
        and any(isinstance(p, Replicate) for p in strategy.inputs)
    )


def partial_grad(node: Node, strategy: Strategy, want) -> bool:
    """Whether an input that ``strategy`` reads replicated (``want``) gets back only this rank's share
    of its gradient, which a backward all-reduce must sum (Megatron's f).  An operand added once to a
    partial sum does not: the gradient arriving at a partial sum is whole on every rank (the forward
    all-reduce's backward is the identity), and it passes to the operand unchanged."""
    return isinstance(want, Replicate) and not strategy.replicated and not adds_once(node, strategy)


_PRODUCTS = ("linear", "matmul")  # families whose second operand is a weight a bias may go with
_TRANSPOSES = ("t", "transpose")


def bias_weights(gm: torch.fx.GraphModule) -> dict:
    """bias parameter node -> the weight parameter node of the product it is added to (``linear(x, w) + b``,
    ``x @ w.t() + b``): where ranks share rows of both (a multi-query projection's K and V), one
    backward all-reduce sums both gradients."""
    found: dict = {}
    for node in gm.graph.nodes:
        if not op(node.target).additive or len(node.args) < 2 or not isinstance(node.args[1], Node):
            continue
        product, bias = node.args[:2]
        if bias.op != "get_attr" or not isinstance(product, Node) or op(product.target).family not in _PRODUCTS:
            continue
        weight = product.args[1]
        while isinstance(weight, Node) and op(weight.target).family in _TRANSPOSES:
            weight = weight.args[0]
        if isinstance(weight, Node) and weight.op == "get_attr" and weight is not bias:
            found[bias] = weight if found.get(bias, weight) is weight else None  # one weight, or none
    return {bias: weight for bias, weight in found.items() if weight is not None}


def gradient_sums(gm: torch.fx.GraphModule, choice: dict, world: int) -> list:
    """The trainable parameters whose gradients ranks sum (held grouped), one list per all-reduce: a bias
    goes with the weight of its product when both are grouped (bias_weights)."""
    trainable = {name for name, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}
    grouped = {
        n: None
        for n in gm.graph.nodes
        if n.op == "get_attr"
        and n in choice
        and n.target in trainable
        and isinstance(choice[n].output, Shard)
        and choice[n].output.grouped(world)
    }
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
    read = {
        src
        for node, strategy in choice.items()
        for src, want in zip(input_slots(node), strategy.inputs, strict=True)
        if src in grad and coalesced(src) and partial_grad(node, strategy, want)
    }
    found: dict = {}
    for node in gm.graph.nodes:
        if node in read:
            found.setdefault(value(node).dtype, []).append(node)
    return list(found.values())
