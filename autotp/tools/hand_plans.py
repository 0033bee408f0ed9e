"""Hand-written plans (transformers' tp_plan, Megatron's, DTensor's ``parallelize_module`` styles) as complete
assignments of the captured graph, for one price beside autotp's.

A hand plan is data: module patterns (``*`` a layer index) and a style each, HF's words (tools/interop.py).  The
styles place the parameters (everything unnamed stays replicated) and say where the plan runs a collective: at a
styled module's output (rowwise: an all-reduce, or a reduce-scatter with sequence parallelism; a gathered colwise:
an all-gather) or its input (with sequence parallelism, a colwise module gathers its tokens).  Nowhere else may a
value change placement, except by a local slice.  The solver then only decides what the plan leaves open (which
local form each op computes in), and the result is priced by ``price_plan`` like the solver's own plan.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from autotp.cost_models.communication import backward_collective, reshard_collective
from autotp.options import PlanOptions
from autotp.passes.capture import module_path
from autotp.plan import Plan
from autotp.planning.solve import Imposed, PlanningError
from autotp.planning.tensor_plan import Attempt, price_plan, solve_plan
from autotp.tools.interop import hf_styles, style_placements

PLANS_FILE = Path(__file__).with_name("hand_plans.json")

# style -> (collectives at its output, at its input; the sequence-parallel forms after "|")
_BOUNDARY = {
    "colwise": ((), ()), "packed_colwise": ((), ()),
    "colwise_gather_output": (("all_gather",), ()), "colwise_rep": (("all_gather",), ()),
    "embedding_colwise": (("all_gather",), ()),
    "rowwise": (("all_reduce",), ()), "rowwise_split_input": (("all_reduce",), ("",)),
    "rowwise_rep": (("all_reduce",), ("",)), "embedding_rowwise": (("all_reduce",), ()),
}
_SEQUENCE_PARALLEL = {"all_reduce": "reduce_scatter"}  # a rowwise output leaves split by tokens


@dataclass(frozen=True)
class HandPlan:
    name: str
    styles: dict                      # module pattern -> style
    sequence_parallel: bool = False   # norms and residuals split by tokens between the styled modules
    grad_sums_per_module: bool = False  # each styled module sums its input's gradient itself (transformers' hooks)
    source: str = ""
    unknown: tuple = field(default=())  # styles with no entry in _BOUNDARY: the plan is not priced (never guessed)


def hand_plans(model: torch.nn.Module, names=("hf", "megatron", "megatron-sp", "dtensor"), prefix: str = "") -> dict:
    """name -> HandPlan for this model: transformers' own (its tp_plan) and the data file's plans each of whose
    patterns names a module of this model (they are written for one layout); ``prefix``: where a wrapper holds
    the model (the decode program's ``model.``), put before every pattern."""
    modules = [name for name, _ in model.named_modules()]
    found = {}
    for name in names:
        if name == "hf":
            styles = hf_styles(model)
            plan = HandPlan("hf", styles, grad_sums_per_module=True,
                            source="transformers' tp_plan for this architecture") if styles else None
        else:
            plans = json.loads(PLANS_FILE.read_text())["plans"]
            entry = {**plans.get(plans[name].get("as"), {}), **plans[name]}  # "as": another plan's styles
            plan = HandPlan(name, entry["styles"], entry.get("sequence_parallel", False), entry["source"])
        if plan and (name == "hf" or all(any(_style_of(m, {p: s}) for m in modules) for p, s in plan.styles.items())):
            found[name] = replace(plan, styles={prefix + p: s for p, s in plan.styles.items()},
                                  unknown=tuple(sorted({s for s in plan.styles.values() if s not in _BOUNDARY})))
    return found


def solve_hand_plan(model: torch.nn.Module, gm: torch.fx.GraphModule, hand: HandPlan, world_size: int,
                    options: PlanOptions) -> Plan | None:
    """The complete assignment that runs ``hand`` on ``gm`` (captured from ``model``), priced by ``price_plan``;
    None where its placements admit no exact program (heads not divisible by the world size)."""
    fixed = {name: "R" for name, _ in model.named_parameters(remove_duplicate=False)}
    fixed.update({name: str(p) for name, p in style_placements(model, hand.styles).items()})
    names = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    options = replace(options, fixed={k: v for k, v in fixed.items() if k in names}, memory_limit=float("inf"),
                      recompute=False)
    imposed = Imposed(_conversions(hand, options.training), hand.grad_sums_per_module)
    try:  # token-split forms offered with sequence parallelism, not imposed: a rowwise output is partial first
        solved = solve_plan(gm, world_size, options, imposed=imposed, attempt=Attempt(hand.sequence_parallel, "off"))
    except PlanningError:
        return None
    return price_plan(gm, solved, options, imposed=imposed)


def _conversions(hand: HandPlan, training: bool):
    """(producer, reader, have, want) -> whether ``hand`` runs that conversion there."""
    def collectives(style: str, side: int) -> set:
        ops = set(_BOUNDARY.get(style, ((), ()))[side])
        if hand.sequence_parallel:
            ops = {_SEQUENCE_PARALLEL.get(op, op) for op in ops}
            if side == 1 and style in ("colwise", "packed_colwise", "colwise_gather_output", "colwise_rep"):
                ops.add("all_gather")  # its tokens gathered on the way in
        return ops

    def allowed(src, reader, have, want) -> bool:
        op = reshard_collective(have, want)
        if op == "" and (src.op == "get_attr" or not training or not backward_collective(have, want)):
            return True  # a local slice (its gradient gathered back only where a style says so)
        left, right = _style_of(module_path(src), hand.styles), _style_of(module_path(reader), hand.styles)
        if left and (right is None or right[0] != left[0]) and op in collectives(left[1], 0):
            return True
        return bool(right and (left is None or left[0] != right[0]) and op in collectives(right[1], 1))
    return allowed


def _style_of(path: str, styles: dict) -> tuple | None:
    """(the styled module ``path`` is in, its style), the innermost first; None outside every styled module."""
    while path:
        for pattern, style in styles.items():
            if re.fullmatch(pattern.replace(".", r"\.").replace("*", r"\d+"), path):
                return path, style
        path = path.rpartition(".")[0]
    return None
