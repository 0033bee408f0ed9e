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
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from autotp.canonicalize.graph_edits import module_path
from autotp.cost_models.communication import backward_collective, reshard_collective
from autotp.options import PlanOptions
from autotp.passes.capture import within
from autotp.placement import Routed
from autotp.plan import Plan
from autotp.planning.solution import Imposed, PlanningError, every_name
from autotp.planning.tensor_plan import Attempt, price_plan, solve_plan
from autotp.tools.interop import hf_styles, pattern_regex, style_placements

PLANS_FILE = Path(__file__).with_name("hand_plans.json")

# style -> (collectives at its output, at its input); "" a local slice, "routed" an expert dispatch or combine
_BOUNDARY = {
    "colwise": ((), ()),
    "packed_colwise": ((), ()),
    "colwise_gather_output": (("all_gather",), ()),
    "colwise_rep": (("all_gather",), ()),
    "embedding_colwise": (("all_gather",), ()),
    "rowwise": (("all_reduce",), ()),
    "rowwise_split_input": (("all_reduce",), ("",)),
    "rowwise_rep": (("all_reduce",), ("",)),
    "embedding_rowwise": (("all_reduce",), ()),
    "moe_tp_experts": (("all_reduce",), ()),  # every expert split: each rank's partial sum of the routed rows
    # whole experts: rows dispatched to their owners and combined back by all-to-all (any conversion of routed
    # rows, at the segment's entry and exit), then gathered by the TP ranks; "grouped_gemm" places them
    "ep_dispatch_experts": (("all_gather", "routed"), ("routed",)),
    "grouped_gemm": ((), ()),
}
_SEQUENCE_PARALLEL = {"all_reduce": "reduce_scatter"}  # a rowwise output leaves split by tokens


@dataclass(frozen=True)
class HandPlan:
    name: str
    styles: dict  # module pattern -> style
    sequence_parallel: bool = False  # norms and residuals split by tokens between the styled modules
    grad_sums_per_module: bool = False  # each styled module sums its input's gradient itself (transformers' hooks)
    saves_gathered: bool = False  # gathered tokens kept whole for the backward (DTensor), not gathered again
    sums_each_param: bool = False  # each replicated parameter's partial gradient summed alone (DTensor's Partial)
    experts: str | None = None  # how its expert layers run (PlanOptions.experts): "all-to-all" for whole experts
    source: str = ""
    unknown: tuple = field(default=())  # styles with no entry in _BOUNDARY: the plan is not priced (never guessed)


def hand_plans(
    model: torch.nn.Module, names=("hf", "hf-ep", "megatron", "megatron-sp", "dtensor"), prefix: str = ""
) -> dict:
    """name -> HandPlan for this model: transformers' own (its tp_plan) and the data file's plans each of whose
    patterns names a module of this model (they are written for one layout); ``prefix``: where a wrapper holds
    the model (the decode program's ``model.``), put before every pattern."""
    modules = [name for name, _ in model.named_modules()]
    plans, own = json.loads(PLANS_FILE.read_text())["plans"], hf_styles(model)
    found = {}
    for name in names:
        if name in ("hf", "hf-ep"):  # hf-ep: its ep_plan over its tp_plan, where it has one
            styles = hf_styles(model, expert_parallel=True) if name == "hf-ep" else own
            if name == "hf-ep" and styles == own:
                continue
            plan = (
                HandPlan(
                    name,
                    styles,
                    grad_sums_per_module=True,
                    experts="all-to-all" if name == "hf-ep" else None,
                    source=f"transformers' {'ep' if name == 'hf-ep' else 'tp'}_plan for this architecture",
                )
                if styles
                else None
            )
        else:
            entry = {**plans.get(plans[name].get("as"), {}), **plans[name]}  # "as": another plan's styles
            plan = HandPlan(
                name,
                entry["styles"],
                sequence_parallel=entry.get("sequence_parallel", False),
                saves_gathered=entry.get("saves_gathered", False),
                sums_each_param=entry.get("sums_each_param", False),
                source=entry["source"],
            )
        named = plan and all(any(_style_of(m, {p: s}) for m in modules) for p, s in plan.styles.items())
        if plan and (name.startswith("hf") or named):
            found[name] = replace(
                plan,
                styles={prefix + p: s for p, s in plan.styles.items()},
                unknown=tuple(sorted({s for s in plan.styles.values() if s not in _BOUNDARY})),
            )
    return found


def solve_hand_plan(
    model: torch.nn.Module, gm: torch.fx.GraphModule, hand: HandPlan, world_size: int, options: PlanOptions
) -> Plan | None:
    """The complete assignment that runs ``hand`` on ``gm`` (captured from ``model``), priced by ``price_plan``;
    None where its placements admit no exact program (heads not divisible by the world size)."""
    fixed = {name: "R" for name, _ in model.named_parameters(remove_duplicate=False)}
    fixed.update({name: str(p) for name, p in style_placements(model, hand.styles).items()})
    if hand.experts:  # the expert tables (3-D) are dealt as the expert strategy deals them
        fixed = {n: p for n, p in fixed.items() if model.get_parameter(n).dim() != 3}
    names = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    options = replace(
        options,
        fixed={k: v for k, v in fixed.items() if k in names},
        memory_limit=float("inf"),
        recompute=False,
        experts=hand.experts or options.experts,
    )
    imposed = Imposed(  # Megatron-SP gathers every kept token piece again in the backward, DTensor none
        _conversions(hand, options.training),
        hand.grad_sums_per_module,
        sums_each_param=hand.sums_each_param,
        regathered=frozenset() if hand.saves_gathered else every_name(gm),
    )
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
        op = "routed" if isinstance(have, Routed) or isinstance(want, Routed) else reshard_collective(have, want)
        if op == "" and (src.op == "get_attr" or not training or not backward_collective(have, want)):
            return True  # a local slice (its gradient gathered back only where a style says so)
        left, right = _style_of(module_path(src), hand.styles), _style_of(module_path(reader), hand.styles)
        if op == "routed":  # a dispatch or combine: at the expert segment's entry or exit, inside the module
            return bool(left and op in collectives(left[1], 0)) or bool(right and op in collectives(right[1], 1))
        # at the module's output, or at the input of its last op (a cast that a partial sum cannot pass exactly)
        last = (
            right and left and right[0] == left[0] and any(not within(module_path(u), (left[0],)) for u in reader.users)
        )
        if left and (right is None or right[0] != left[0] or last) and op in collectives(left[1], 0):
            return True
        return bool(right and (left is None or left[0] != right[0]) and op in collectives(right[1], 1))

    return allowed


def _style_of(path: str, styles: dict) -> tuple | None:
    """(the styled module ``path`` is in, its style), the innermost first; None outside every styled module."""
    while path:
        for pattern, style in styles.items():
            if pattern_regex(pattern).fullmatch(path):
                return path, style
        path = path.rpartition(".")[0]
    return None
