"""A graph's routed experts, read for the mesh planner (cost_models/expert_layout.py prices them).

Which ops compute expert rows and which parameters are experts is what autotp's own expert rules say: a plan
over two ranks with whole experts imposed holds exactly those ops' outputs as disjoint partial sums (rows only
their experts' rank computes).  No module or model names are read.  Per block, from the TP plan (experts split
over its tp ranks): the ragged grouped products' shapes and seconds, the bytes a dispatch moves and the experts'
parameter bytes, per sample.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch.fx import Node

from autotp.cost_models.expert_layout import Experts
from autotp.cost_models.pricing import Sizes, op_memory, op_seconds, product_shape
from autotp.cost_models.topology import Topology
from autotp.ops.strategies import Strategy, input_slots, replicated_like
from autotp.ops.table import is_product, op
from autotp.options import PlanOptions
from autotp.placement import Disjoint, parse
from autotp.planning.solution import PlanningError
from autotp.planning.tensor_plan import solve_plan


def expert_part(gm: torch.fx.GraphModule, topology: Topology, sizes: Sizes) -> tuple[set[Node], set[Node]] | None:
    """(ops computing routed rows, expert parameters), or None for a graph without routed experts."""
    if "autotp_expert_part" not in gm.meta:
        gm.meta["autotp_expert_part"] = _expert_part(gm, topology, sizes)
    return cast("tuple[set[Node], set[Node]] | None", gm.meta["autotp_expert_part"])


def _expert_part(gm: torch.fx.GraphModule, topology: Topology, sizes: Sizes) -> tuple[set[Node], set[Node]] | None:
    try:
        plan = solve_plan(
            gm,
            2,
            PlanOptions(
                topology=topology, training=False, memory_limit=math.inf, experts="parallel", sequence_parallel=False
            ),
            sizes=sizes,
        )
    except PlanningError:
        return None
    nodes = {n.name: n for n in gm.graph.nodes}

    def disjoint(out: Any) -> bool:
        return isinstance(out, Disjoint) or (isinstance(out, tuple) and any(map(disjoint, out)))

    ops = {nodes[name] for name, entry in plan.nodes.items() if disjoint(parse(entry["out"]))}
    params = {p for node in ops for a in input_slots(node) for p in _stored(a)}
    return (ops, params) if params else None


def _stored(node: torch.fx.Node) -> list[Node]:
    """The parameters a value is (through layout ops: a transpose, ``w[ids]``)."""
    if node.op == "get_attr":
        return [node]
    if node.op == "call_function" and op(node.target).layout and node.args:
        return _stored(cast(Node, node.args[0]))
    return []


def block_experts(
    part: tuple[set[Node], set[Node]],
    choice: Mapping[Node, Strategy],
    where: Mapping[Node, Any],
    sizes: Sizes,
    tp: int,
    topology: Topology,
    training: bool,
    trainable: dict[str, Any],
    unit: int,
    scale: float,
) -> dict[Any, Experts]:
    """Block key -> its Experts under the TP plan ``choice`` (seconds multiplied by ``scale``, as the planner's
    sections are to the solver's total), per sample."""
    ops, params = part
    found: dict[Any, Experts] = {}
    for node in (n for n in choice if n in ops or n in params):
        e = found.setdefault(where[node], Experts(0, [], 0.0, 0.0))
        strategy = choice[node]
        if node in params:
            e.count = node.meta["val"].shape[0]
            whole = Strategy((), replicated_like(node))
            for part_, held in (
                (e.state, op_memory(node, strategy, sizes, tp, trainable, training)),
                (e.whole, op_memory(node, whole, sizes, 1, trainable, training)),
            ):
                for kind, nbytes in held.items():
                    part_[kind] = part_.get(kind, 0.0) + nbytes
            continue
        if not is_product(node):
            continue
        e.routed_bytes = sizes.nbytes(node) / unit  # the last product's rows go back to their tokens
        _, n_tp, k_tp, _, ragged = product_shape(node, strategy, sizes, tp)
        if ragged:
            rows, n, k, _, _ = product_shape(
                node, Strategy(tuple(map(replicated_like, input_slots(node))), replicated_like(node)), sizes, 1
            )
            e.products.append((rows / unit, n_tp, k_tp, n, k))
            e.seconds += op_seconds(node, strategy, sizes, tp, topology, training) * scale / unit
    return {key: e for key, e in found.items() if e.count and e.routed_bytes}
