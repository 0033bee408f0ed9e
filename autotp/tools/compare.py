"""`autotp compare`: hand-written plans for the architecture priced beside autotp's, each by the one price the
solver's own plan gets (planning/tensor_plan.price_plan).

The dense plans (transformers' tp_plan, Megatron's with and without sequence parallelism, torchtitan's DTensor
plan) are complete assignments of the captured graph (tools/hand_plans.py): the parameters where the plan puts
them, and collectives only where its styles run them.  transformers' expert-parallel plan (its ep_plan) and tp_plans
with expert styles are still priced the older way: compute as the solver places activations around the plan's
parameters, collectives as the hooked modules run them (STYLES below, counted per call from the graph).
tests/test_interop.py checks both against the collectives transformers is measured to run.
"""
from __future__ import annotations

import re
from dataclasses import replace

import torch

from autotp.cost_models import collective_time
from autotp.cost_models.pricing import priced_unit
from autotp.options import PlanOptions
from autotp.passes.capture import module_path
from autotp.passes.prepared_graph import prepared_graph
from autotp.plan import Plan
from autotp.planning.solve import PlanningError
from autotp.planning.tensor_plan import solve_plan
from autotp.tools.hand_plans import hand_plans, solve_hand_plan
from autotp.tools.interop import hf_parameter_placements

AGAINST = ("hf", "megatron", "megatron-sp", "dtensor")

# style -> (forward, backward) collectives per call of the hooked module, in training: (op, what it moves) with
# "in" the module's input, "out" its output, "weights" its routing weights (an experts module), "rows" every routed
# (token, expert) row, "counts" the rows' per-expert counts; parameter-only styles (packed_colwise, grouped_gemm on a
# parameter) place weights and run nothing
STYLES = {
    "colwise": ((), (("all_reduce", "in"),)),
    "colwise_gather_output": ((("all_gather", "out"),), (("all_reduce", "in"),)),
    "colwise_rep": ((("all_gather", "out"),), (("all_reduce", "in"),)),
    "rowwise": ((("all_reduce", "out"),), ()),
    "rowwise_split_input": ((("all_reduce", "out"),), (("all_gather", "in"),)),
    "rowwise_rep": ((("all_reduce", "out"),), (("all_gather", "in"),)),
    "embedding_rowwise": ((("all_reduce", "out"),), ()),
    "embedding_colwise": ((("all_gather", "out"),), ()),
    "moe_tp_experts": ((("all_reduce", "out"),), (("all_reduce", "in"), ("all_reduce", "weights"))),
    # the TP group's ranks each send their slice of the tokens, then gather the combined rows back
    "ep_dispatch_experts": ((("all_to_all", "counts"), ("all_to_all", "rows"), ("all_to_all", "rows"),
                             ("all_gather", "out")),
                            (("all_to_all", "rows"), ("all_to_all", "rows"), ("all_gather", "in"),
                             ("all_gather", "weights"))),
}


def summary(plan: Plan) -> dict:
    comm = {phase: sum(c["seconds"] * c["count"] for c in plan.collectives if c["phase"] == phase)
            for phase in ("forward", "backward")}
    return {"seconds": plan.cost["seconds"], "forward": dict(plan.collective_counts("forward")),
            "backward": dict(plan.collective_counts("backward")), "comm_seconds": comm,
            "param_bytes": plan.cost["memory"]["params"], "memory": plan.cost["memory"]["total"], "unpriced": []}


def compare(model: torch.nn.Module, args=None, kwargs=None, *, world_size: int, topology=None,
            training: bool = True, memory_limit: float | None = None, against=AGAINST) -> dict:
    """{"autotp": summary, and for each plan of ``against`` that names modules of this model its summary (None:
    its placements cut whole heads at this world size, so no exact program runs them; "hf": transformers'
    tp_plan), "hf_invalid": why transformers' placements cannot run this model exactly, or None, "hf_ep": its
    ep_plan over the tp_plan, where it has one}.  A summary lists under "unpriced" the styles whose collectives
    autotp does not know (never guessed)."""
    gm = prepared_graph(model, args, kwargs, fold=True)
    options = PlanOptions(topology=topology, training=training, memory_limit=memory_limit)
    result = {"autotp": summary(solve_plan(gm, world_size, options)), "hf": None, "hf_invalid": None,
              "hf_ep": None}
    for name, hand in hand_plans(model, against).items():
        if hand.unknown:  # expert styles: priced as the hooked modules run them
            result[name] = _hooked(model, gm, dict(hand.styles), False, world_size, options)
        else:
            solved = solve_hand_plan(model, gm, hand, world_size, options)
            result[name] = summary(solved) if solved else False
    if result["hf"] is False:
        result["hf"], result["hf_invalid"] = None, (
            f"its even splits cut through attention heads or other whole units at TP {world_size}, so no exact "
            "program uses those placements")
    ep_styles = {**dict(getattr(model, "tp_plan", None) or {}), **(getattr(model, "ep_plan", None) or {})}
    if "hf" in against and ep_styles != dict(getattr(model, "tp_plan", None) or {}):
        result["hf_ep"] = _hooked(model, gm, ep_styles, True, world_size, options) or None
    return result


def _hooked(model, gm: torch.fx.GraphModule, styles: dict, expert_parallel: bool, world_size: int,
            options: PlanOptions):
    placements = hf_parameter_placements(model, expert_parallel)
    try:
        placed = solve_plan(gm, world_size, replace(options, fixed=placements))
    except PlanningError:
        return False
    return as_run(gm, placed, styles, world_size, options.topology, options.training)


def as_run(gm: torch.fx.GraphModule, placed: Plan, styles: dict, world: int, topology, training: bool) -> dict:
    """A transformers plan's summary: compute as ``placed`` (transformers' parameter placements) prices it,
    collectives as its hooked modules run them."""
    collectives, unpriced = hooked_collectives(gm, styles, training)
    counts: dict = {"forward": {}, "backward": {}}
    comm = {"forward": 0.0, "backward": 0.0}
    for phase, op, nbytes, count in collectives:
        counts[phase][op] = counts[phase].get(op, 0) + count
        comm[phase] += count * collective_time(op, nbytes, world, topology)
    return {"seconds": placed.cost["compute_seconds"] + sum(comm.values()), **counts, "comm_seconds": comm,
            "param_bytes": placed.cost["memory"]["params"], "memory": placed.cost["memory"]["total"],
            "unpriced": sorted(unpriced)}


def hooked_collectives(gm: torch.fx.GraphModule, styles: dict, training: bool) -> tuple[list, set]:
    """[(phase, op, bytes, calls)] for each module a style hooks, and the styles with no entry in STYLES."""
    _, sizes = priced_unit(gm)
    folding = gm.meta.get("autotp_fold")
    weight = folding.weights.get if folding else (lambda n, d: d)
    patterns = [(re.compile(pattern.replace(".", r"\.").replace("*", r"\d+")), style)
                for pattern, style in styles.items()]
    calls: dict = {}
    for node in gm.graph.nodes:
        path = module_path(node)
        while path:
            style = next((s for regex, s in patterns if regex.fullmatch(path)), None)
            if style is not None:
                calls.setdefault((path, style), []).append(node)
                break
            path = path.rpartition(".")[0]
    found, unpriced = [], set()
    for (_, style), nodes in calls.items():
        if style not in STYLES:
            unpriced.add(style)
            continue
        moved = _moved(nodes, sizes)
        for phase, steps in zip(("forward", "backward"), STYLES[style], strict=True):
            if phase == "backward" and not training:
                continue
            found += [(phase, op, moved[what], max(weight(n, 1) for n in nodes)) for op, what in steps]
    return found, unpriced


def _moved(nodes: list, sizes) -> dict:
    """Bytes of what a module call moves: its input (the largest floating tensor it reads from outside), its
    output (the last value used outside), its routing weights (the smallest floating input) and routed rows."""
    inside = set(nodes)
    outside = [a for n in nodes for a in n.all_input_nodes if a not in inside and _floating(a)]
    out = [n for n in nodes if _floating(n) and any(u not in inside for u in n.users)]
    by_size = sorted(dict.fromkeys(outside), key=sizes.nbytes)
    moved = {"in": sizes.nbytes(by_size[-1]) if by_size else 0.0, "out": sizes.nbytes(out[-1]) if out else 0.0,
             "weights": sizes.nbytes(by_size[0]) if by_size else 0.0}
    if by_size:
        rows = sizes.numel(by_size[0]) * sizes(by_size[-1].meta["val"].shape[-1])  # (token, expert) pairs x hidden
        moved.update(rows=rows * by_size[-1].meta["val"].element_size(), counts=0.0)  # counts: a latency
    return moved


def _floating(node: torch.fx.Node) -> bool:
    v = node.meta.get("val")
    return isinstance(v, torch.Tensor) and v.is_floating_point()
