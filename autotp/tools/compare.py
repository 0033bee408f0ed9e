"""`autotp compare`: hand-written plans for the architecture priced beside autotp's, each by the one price the
solver's own plan gets (planning/tensor_plan.price_plan).

The dense plans (transformers' tp_plan, Megatron's with and without sequence parallelism, torchtitan's DTensor
plan, transformers' ep_plan with whole experts fed by all-to-all) are complete assignments of the captured graph
(tools/hand_plans.py): the parameters where the plan puts them, and collectives only where its styles run them.
tests/test_interop.py checks transformers' plans against the collectives transformers is measured to run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads when a comparison runs, not when the command line lists the choices
    import torch

    from autotp.plan import Plan

AGAINST = ("hf", "megatron", "megatron-sp", "dtensor")
NOT_PRICED = float("nan")


def summary(plan: Plan) -> dict:
    comm = {
        phase: sum(c["seconds"] * c["count"] for c in plan.collectives if c["phase"] == phase)
        for phase in ("forward", "backward")
    }
    return {
        "seconds": plan.cost["seconds"],
        "forward": dict(plan.collective_counts("forward")),
        "backward": dict(plan.collective_counts("backward")),
        "comm_seconds": comm,
        "param_bytes": plan.cost["memory"]["params"],
        "memory": plan.cost["memory"]["total"],
        "unpriced": [],
    }


def compare(
    model: torch.nn.Module,
    args=None,
    kwargs=None,
    *,
    world_size: int,
    topology=None,
    training: bool = True,
    memory_limit: float | None = None,
    against=AGAINST,
) -> dict:
    """{"autotp": summary, and for each plan of ``against`` that names modules of this model its summary (None:
    its placements cut whole heads at this world size, so no exact program runs them; "hf": transformers'
    tp_plan), "hf_invalid": why transformers' placements cannot run this model exactly, or None, "hf_ep": its
    ep_plan over the tp_plan, where it has one}.  A summary lists under "unpriced" the styles whose collectives
    autotp does not know (never guessed)."""
    from autotp.options import PlanOptions
    from autotp.passes.prepared_graph import prepared_graph
    from autotp.planning.tensor_plan import solve_plan
    from autotp.tools.hand_plans import hand_plans, solve_hand_plan

    gm = prepared_graph(model, args, kwargs, fold=True)
    options = PlanOptions(topology=topology, training=training, memory_limit=memory_limit)
    result = {"autotp": summary(solve_plan(gm, world_size, options)), "hf": None, "hf_invalid": None, "hf_ep": None}
    names = (*against, "hf-ep") if "hf" in against else tuple(against)
    for name, hand in hand_plans(model, names).items():
        if hand.unknown:  # styles autotp does not know: not priced (never guessed)
            result[name] = {
                "seconds": NOT_PRICED,
                "forward": {},
                "backward": {},
                "param_bytes": NOT_PRICED,
                "memory": NOT_PRICED,
                "comm_seconds": {},
                "unpriced": list(hand.unknown),
            }
            continue
        solved = solve_hand_plan(model, gm, hand, world_size, options)
        result[name] = summary(solved) if solved else False
    if result["hf"] is False:
        result["hf"], result["hf_invalid"] = (
            None,
            (
                f"its even splits cut through attention heads or other whole units at TP {world_size}, so no exact "
                "program uses those placements"
            ),
        )
    result["hf_ep"] = result.pop("hf-ep", None) or None
    return result
