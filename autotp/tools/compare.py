"""`autotp compare`: Hugging Face's hand-written tp_plan for the architecture, priced with autotp's
cost model (its parameter placements imposed, everything else solved), beside autotp's own plan."""
from __future__ import annotations

from dataclasses import replace

import torch

from autotp.api import prepared_graph, solve_plan
from autotp.interop import hf_parameter_placements
from autotp.options import Options
from autotp.passes.solve import PlanningError
from autotp.plan import Plan


def summary(plan: Plan) -> dict:
    return {"seconds": plan.cost["seconds"], "forward": dict(plan.collective_counts("forward")),
            "backward": dict(plan.collective_counts("backward")),
            "param_bytes": plan.cost["memory"]["params"], "memory": plan.cost["memory"]["total"]}


def compare(model: torch.nn.Module, args=None, kwargs=None, *, world_size: int, topology=None,
            training: bool = True, memory_limit: float | None = None) -> dict:
    """{"autotp": summary, "hf": summary or None (no tp_plan for this architecture), "hf_invalid": why
    HF's plan cannot run this model exactly (e.g. heads not divisible by the world size), or None, "hf_ep":
    HF's expert-parallel plan (its ep_plan over the tp_plan: whole experts per rank), where it has one and
    it runs exactly}."""
    gm = prepared_graph(model, args, kwargs, fold=True)
    options = Options(topology=topology, training=training, memory_limit=memory_limit)
    ours = summary(solve_plan(gm, world_size, options))

    def priced(fixed: dict):
        """HF's placements imposed: a summary, None where there are none, False where none runs exactly."""
        try:
            return summary(solve_plan(gm, world_size, replace(options, fixed=fixed))) if fixed else None
        except PlanningError:
            return False

    tp, ep = hf_parameter_placements(model), hf_parameter_placements(model, expert_parallel=True)
    theirs = priced(tp)
    invalid = (f"its even splits cut through attention heads or other whole units at TP {world_size}, so no "
               "exact program uses those placements") if theirs is False else None
    whole_experts = (priced(ep) or None) if ep != tp else None  # an ep_plan changes some placements
    return {"autotp": ours, "hf": theirs or None, "hf_invalid": invalid, "hf_ep": whole_experts}
