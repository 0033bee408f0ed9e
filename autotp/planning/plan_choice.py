"""A saved plan read back onto a graph for the rewrite: each node's strategy, the nodes it recomputes and those
whose gathered tokens it gathers again, a folded plan's block-1 decisions stamped on every middle block."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from autotp.ops.strategies import Strategy
from autotp.passes.fold import Fold, NotFoldable, fold_graph
from autotp.plan import Plan, PlanMismatch


@dataclass(frozen=True)
class Planned:
    """What the rewrite reads of a plan on one graph."""

    choice: dict[Node, Strategy]  # each planned node's strategy
    recomputed: frozenset[Node]  # the nodes the backward computes again
    # the nodes whose tokens, gathered for an op that keeps them, are kept as this rank's piece and gathered again
    # in the backward (Plan.regathers; the others are kept whole)
    regathered: frozenset[Node]


def plan_choice(gm: torch.fx.GraphModule, plan: Plan, graph_hash: str, world: int) -> dict[Node, Strategy]:
    """node -> Strategy from the plan; a folded plan's block-1 decisions stamped on every middle block."""
    return planned(gm, plan, graph_hash, world).choice


def planned(gm: torch.fx.GraphModule, plan: Plan, graph_hash: str, world: int) -> Planned:
    """The plan on ``gm``, checked against the graph's fingerprint and the world size."""
    names = {node: node.name for node in gm.graph.nodes}
    if plan.fold:
        repeats = Fold(**plan.fold)
        try:
            folding = fold_graph(gm, repeats)
        except NotFoldable as exc:
            raise PlanMismatch(
                f"the plan folds {repeats.count} blocks of {repeats.path}, but in this model's graph "
                f"{exc}: re-plan with fold=False"
            ) from None
        graph_hash = folding.fingerprint(gm)
        by_key = {entry.get("key"): name for name, entry in plan.nodes.items()}
        names = {node: by_key.get(folding.blocks.key[node]) for node in gm.graph.nodes}
    plan.check(graph_hash, world)
    choice: dict[Node, Strategy] = {}
    recomputed: set[Node] = set()
    regathered: set[Node] = set()
    for node, name in names.items():
        if name in plan.nodes:
            inputs, output = plan.strategy(name)
            choice[node] = Strategy(tuple(inputs), output)
            if plan.nodes[name].get("recompute"):
                recomputed.add(node)
            if plan.regathers(name):
                regathered.add(node)
    return Planned(choice, frozenset(recomputed), frozenset(regathered))
