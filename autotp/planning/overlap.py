"""Asynchronous TP priced in the sharding ILP: under inductor's micro-pipeline TP pass an all-gather of token
pieces read by a matmul's rows, and a matmul's partial sums reduce-scattered to token pieces, run fused (each
split into one chunk per rank that overlaps the other's), priced by ``cost_models.communication.fused_time``
instead of the collective plus the product.

The pass fuses every pair it finds, so a plan solved with ``async_tp`` on prices every fusable pair fused, where
that pays and where it does not.  A pair is fusable where the pieces are even and in rank order (runtime/
collectives.py ``in_rank_order``): a padded, uneven token split is priced as before, the collective then the
product.  Training prices the backward's mirror pair too: the all-gather's gradient is reduce-scattered from the
product of the gradient with the weight, the reduce-scatter's gradient all-gathered into that product.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import pulp
from torch.fx import Node

from autotp.cost_models import collective_time
from autotp.cost_models.communication import fused_saving, reshard_collective
from autotp.cost_models.pricing import op_seconds
from autotp.ops.table import op
from autotp.placement import Disjoint, Partial, Replicate, Shard
from autotp.runtime.collectives import in_rank_order

if TYPE_CHECKING:
    from autotp.planning.ilp import Ilp

# the ops inductor's pass fuses with a collective: products of rows by a matrix (not attention, not grouped)
FUSED_FAMILIES = ("linear", "matmul")
BACKWARD = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather"}


def even_tokens(node: Node, placement: Any, sizes: Any, world: int) -> bool:
    """Whether ``placement`` holds ``node``'s rows as ``world`` even pieces in rank order, not its contracted
    (last) dim: the pieces inductor's pass chunks without pads."""
    shape = node.meta["val"].shape
    return (
        isinstance(placement, Shard)
        and placement.dim < len(shape) - 1
        and in_rank_order(placement, sizes(shape[placement.dim]), world)
    )


def fused_gather(src: Node, reader: Node, slot: int, have: Any, want: Any, sizes: Any, world: int) -> bool:
    """An all-gather of ``src``'s token pieces read whole as the rows of a matmul (its first operand)."""
    return (
        slot == 0
        and op(reader.target).family in FUSED_FAMILIES
        and isinstance(want, Replicate)
        and reshard_collective(have, want) == "all_gather"
        and even_tokens(src, have, sizes, world)
    )


def fused_scatter(src: Node, have: Any, want: Any, sizes: Any, world: int) -> bool:
    """A matmul's partial sums reduce-scattered to token pieces."""
    return (
        src.op == "call_function"
        and op(src.target).family in FUSED_FAMILIES
        and isinstance(have, Partial)
        and not isinstance(have, Disjoint)
        and reshard_collective(have, want) == "reduce_scatter"
        and even_tokens(src, want, sizes, world)
    )


def price_overlap(ilp: Ilp) -> None:
    """Credit every fusable pair the solve chose with what fusing saves: per conversion (tensor, from, to), the
    sum over the products it fuses with, at most what fusing with one long product saves (one collective
    overlaps however many products read it).  Needs ``ilp.edges()`` first (the conversions and their links)."""
    problem, strategies, world = ilp.problem, ilp.found.strategies, ilp.world
    credits: dict[tuple[Node, Any, Any], tuple[str, list[Any]]] = {}  # conversion -> (its collective, credits)
    count = itertools.count()  # names of the pair variables
    for src, reader, slot, links in ilp.links:
        for (have, want), z in links.items():
            if slot is None or not fused_gather(src, reader, slot, have, want, ilp.sizes, world):
                continue
            terms = credits.setdefault((src, have, want), ("all_gather", []))[1]
            for var, s in zip(ilp.x[reader], strategies[reader], strict=True):
                if s.inputs[slot] == want:
                    both = _both(problem, z, var, f"fused{next(count)}")
                    terms.append(both * _saving(ilp, src, reader, s, "all_gather"))
    for (src, have, want), n in ilp.need.items():
        if fused_scatter(src, have, want, ilp.sizes, world):
            terms = credits.setdefault((src, have, want), ("reduce_scatter", []))[1]
            for var, s in zip(ilp.x[src], strategies[src], strict=True):
                if s.output == have:
                    both = _both(problem, n, var, f"fused{next(count)}")
                    terms.append(both * _saving(ilp, src, src, s, "reduce_scatter"))
    for k, (key, (forward, terms)) in enumerate(credits.items()):
        saved = problem.add_variable(f"overlap{k}", lowBound=None)
        problem += saved <= pulp.lpSum(terms)
        problem += saved <= ilp.need[key] * _fused_savings(ilp, key[0], forward)  # the most one collective saves
        ilp.costs.append(-saved * ilp.weight(key[0], 1))
        ilp.overlap.append((key, saved))


def _both(problem: pulp.LpProblem, a: Any, b: Any, name: str) -> Any:
    """A variable equal to a AND b for 0/1 values (the pass fuses every pair it finds, paying or not)."""
    var = problem.add_variable(name, lowBound=0, upBound=1)
    problem += var <= a
    problem += var <= b
    problem += var >= a + b - 1
    return var


def _saving(ilp: Ilp, tensor: Node, product: Node, strategy: Any, forward: str) -> float:
    """Seconds saved by fusing ``forward`` (of ``tensor``) with ``product`` under ``strategy``, and in training
    the backward's mirror pair (the product of the gradient has the forward's shape)."""
    return _fused_savings(
        ilp, tensor, forward, op_seconds(product, strategy, ilp.sizes, ilp.world, ilp.topology, training=False)
    )


def _fused_savings(ilp: Ilp, tensor: Node, forward: str, product_s: float | None = None) -> float:
    """What fusing each collective of ``tensor`` (``forward``, and its mirror in training) with a product of
    ``product_s`` seconds saves (None: a product as long as the collective)."""
    total = 0.0
    for c in _collectives(ilp, tensor, forward):
        seconds = collective_time(c, ilp.sizes.nbytes(tensor), ilp.world, ilp.topology)
        total += fused_saving(seconds, seconds if product_s is None else product_s, ilp.world, ilp.topology)
    return total


def _collectives(ilp: Ilp, tensor: Node, forward: str) -> list[str]:
    return [forward, BACKWARD[forward]] if ilp.training and tensor in ilp.grad else [forward]
