"""`autotp compare`: Hugging Face's hand-written tp_plan for the architecture, priced with autotp's
cost model (its parameter placements imposed, everything else solved), beside autotp's own plan."""
from __future__ import annotations

import torch

from autotp.api import _graph, _solve
from autotp.interop import hf_parameter_placements
from autotp.passes.solve import PlanningError
from autotp.plan import Plan


def summary(plan: Plan) -> dict:
    return {"seconds": plan.cost["seconds"], "forward": dict(plan.collective_counts("forward")),
            "backward": dict(plan.collective_counts("backward")),
            "param_bytes": plan.cost["memory"]["params"], "memory": plan.cost["memory"]["total"]}


def compare(model: torch.nn.Module, args=None, kwargs=None, *, world_size: int, topology=None,
            training: bool = True) -> dict:
    """{"autotp": summary, "hf": summary or None (no tp_plan for this architecture), "hf_invalid": why
    HF's plan cannot run this model exactly (e.g. heads not divisible by the world size), or None}."""
    gm = _graph(model, args, kwargs, fold=True)
    ours = summary(_solve(gm, world_size, topology, training=training))
    fixed = hf_parameter_placements(model)
    theirs, invalid = None, None
    if fixed:
        try:
            theirs = summary(_solve(gm, world_size, topology, training=training, fixed=fixed))
        except PlanningError:
            invalid = (f"its even splits cut through attention heads or other whole units at TP {world_size}, so no "
                       "exact program uses those placements")
    return {"autotp": ours, "hf": theirs, "hf_invalid": invalid}
