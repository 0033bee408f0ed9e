"""The tensor-parallel plan of a prepared graph: analyse -> candidates -> solve -> plan, each step a value.

``solve_plan`` is what ``autotp.plan``, ``parallelize`` (on rank 0), the mesh planner and the stage splitter
call; ``plan_choice`` reads a plan back onto a graph for the rewrite.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, cast

import torch
from torch.fx import Node

from autotp.canonicalize.graph_edits import module_path
from autotp.cost_models import load_topology
from autotp.cost_models.pricing import Experts, Sizes, activation_bytes, input_sizes
from autotp.cost_models.topology import Topology
from autotp.ops.quantized_rules import quantized_layout
from autotp.ops.strategies import Strategy, input_slots, needs_grad, on_tokens, token_inputs
from autotp.ops.table import drops
from autotp.options import PlanOptions
from autotp.passes.capture import fingerprint, target_name
from autotp.passes.kept_tensors import kept_gathered
from autotp.passes.styles import param_styles
from autotp.placement import Disjoint, Routed, Shard
from autotp.plan import Plan, PlanMismatch
from autotp.planning.accounting import alternatives, planned_collectives
from autotp.planning.analysis import candidates
from autotp.planning.candidates import Candidates
from autotp.planning.solution import DoesNotFit, Imposed, PlanningError, Solution
from autotp.planning.solve import solve
from autotp.runtime.progress import step

# What only a training step holds (cost_models.memory.breakdown's kinds): an inference plan lists none of them
BACKWARD_MEMORY = ("grads", "optimizer", "activations")


@dataclass(frozen=True)
class Attempt:
    """One solve of a plan's search: sequence parallelism on or off, how attention cores are recomputed ("off",
    "forced" for every core, "priced" per core where memory demands it), and whether the collectives that
    inductor's micro-pipeline TP pass fuses with their matmuls are priced fused (asynchronous TP)."""

    tokens: bool
    recompute: str
    fused: bool = False


def attempts(options: PlanOptions) -> list[Attempt]:
    """The solves to try: without sequence parallelism and with it (only what ``options`` leave open, None), with
    sequence parallelism also priced with asynchronous TP where ``options.async_tp`` is None (only split tokens
    have collectives the pass fuses), then, training, recomputing attention cores where memory demands it
    (Korthikanti et al.)."""
    mode, fused = "forced" if options.recompute else "off", options.async_tp is True
    tokens = [bool(options.sequence_parallel)] if options.sequence_parallel is not None else [False, True]
    found = [Attempt(t, mode, fused) for t in tokens]
    if options.async_tp is None:
        found += [Attempt(True, mode, True) for t in tokens if t]
    if options.recompute is None and options.training:
        found.append(Attempt(found[-1].tokens, "priced", found[-1].fused))
    return found


def solve_plan(
    gm: torch.fx.GraphModule,
    world_size: int,
    options: PlanOptions | None = None,
    *,
    sizes: Sizes | None = None,
    price_experts: bool = False,
    imposed: Imposed | None = None,
    attempt: Attempt | None = None,
) -> Plan:
    """The plan for ``world_size`` ranks: the cheaper of the plans with and without sequence parallelism that fit
    (the earlier on a tie), else the first recomputing plan that fits.  ``price_experts``: also solve with each
    expert strategy imposed, keep the cheapest plan and list them (``plan.cost["experts"]``).  ``imposed`` (solve's)
    and ``attempt`` (the one solve to run): a hand-written plan's."""
    options = options or PlanOptions()
    tries, best = [attempt] if attempt else attempts(options), None
    priced: dict[bool, float] = {}  # fused or not -> the cheapest plan's seconds
    with step(f"solving the plan for {world_size} ranks (ILP)", total=len(tries)) as advance:
        for k, attempt in enumerate(tries):
            if best is not None and attempt.recompute == "priced":  # recomputation only where nothing else fits
                break
            if best is not None and attempt.tokens and not token_inputs(gm.graph):  # no tokens to split: the same
                continue
            try:
                found = _solve_once(gm, world_size, options, sizes, attempt, price_experts, imposed=imposed)
            except DoesNotFit:
                if k == len(tries) - 1 and best is None:
                    raise
                continue
            finally:
                advance()
            priced[attempt.fused] = min(priced.get(attempt.fused, math.inf), found.cost["seconds"])
            if best is None or found.cost["seconds"] < best.cost["seconds"] * (1 - 1e-9):
                best = found
    best = cast(Plan, best)  # the last try raises where none fits
    best.cost["async_tp"]["why"] = _async_reason(options, priced)
    return best


def _async_reason(options: PlanOptions, priced: dict[bool, float]) -> str:
    """Why the plan runs with asynchronous TP or without, in one line (plan.cost["async_tp"]["why"])."""
    if options.async_tp:
        return "async_tp=True"
    if options.async_tp is False:
        return "async_tp=False (the default; None is False off a CUDA group over NCCL, which the fused ops need)"
    if len(priced) < 2:
        return "nothing to fuse: no plan with split tokens was priced"
    return f"priced: {priced[True]:.4g} s a step with the fusable collectives fused, {priced[False]:.4g} s without"


def checked_topology(world_size: int, options: PlanOptions) -> Topology:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    topo = load_topology(options.topology)
    if world_size > topo.devices:
        raise ValueError(
            f"world size {world_size} is larger than topology {topo.name} ({topo.devices} devices): "
            "pick a topology with more devices (e.g. 2x-dgx-h100) or a smaller world size"
        )
    return topo


def price_plan(
    gm: torch.fx.GraphModule,
    plan: Plan,
    options: PlanOptions | None = None,
    *,
    sizes: Sizes | None = None,
    imposed: Imposed | None = None,
) -> Plan:
    """A complete assignment priced by the solver's own objective: ``plan``'s strategy for every node of ``gm``
    (the graph it was solved on), nothing left to choose but what the strategies imply (the conversions between
    them, the gradient sums, recomputation where the plan recomputes, the gathered tokens it re-gathers).  The one
    price every plan gets, the solver's and a hand-written one's alike (tools/compare.py)."""
    options = replace(
        options or PlanOptions(),
        training=plan.cost.get("training", True),
        sequence_parallel=False,
        memory_limit=float("inf"),
    )  # priced as it stands, fitting or not (its memory is reported)
    placed = {node: plan.strategy(node.name) for node in gm.graph.nodes if node.name in plan.nodes}
    choice = {node: Strategy(tuple(inputs), output) for node, (inputs, output) in placed.items()}
    # a plan recomputes attention cores where memory demanded it: priced as recomputing each (the solver's
    # "priced" attempts may take some), exact for plans that recompute none or all
    recompute = "forced" if any(entry.get("recompute") for entry in plan.nodes.values()) else "off"
    imposed = replace(imposed or Imposed(), regathered=frozenset(n for n in plan.nodes if plan.regathers(n)))

    def one_each(found: Candidates) -> Candidates:
        missing = [n.name for n in found.strategies if n not in choice]
        if missing:
            raise PlanMismatch(
                f"the plan places no strategy for {len(missing)} node(s) of this graph ({missing[0]}, "
                "...): price it on the graph it was solved on"
            )
        return replace(found, strategies=MappingProxyType({n: [choice[n]] for n in found.strategies}))

    return _solve_once(
        gm,
        plan.world_size,
        options,
        sizes,
        Attempt(False, recompute, plan.cost.get("async_tp", {}).get("chosen", False)),
        False,
        restrict=one_each,
        imposed=imposed,
    )


def _solve_once(
    gm: torch.fx.GraphModule,
    world_size: int,
    options: PlanOptions,
    sizes: Sizes | None,
    attempt: Attempt,
    price_experts: bool,
    *,
    imposed: Imposed | None = None,
    restrict: Callable[[Candidates], Candidates] | None = None,
) -> Plan:
    topo = checked_topology(world_size, options)
    options = replace(options, async_tp=attempt.fused)
    if options.ep > 1 and world_size == 1 and options.experts is None:
        options = replace(options, experts="all-to-all")  # no TP to split experts over: whole, dealt over "ep"
    found = candidates(gm, world_size, options, attempt.tokens, options.experts)
    found = restrict(found) if restrict else found
    priced = input_sizes(gm, options.price_at) if options.price_at else {}
    sizes = Sizes(
        {**priced, **(sizes.overrides if sizes else {})}, Experts(options.expert_imbalance, options.ep, found.segments)
    )
    folding = gm.meta.get("autotp_fold")
    if folding and any(found.strategies.get(a) != found.strategies.get(b) for a, b in folding.ties):
        raise PlanningError(
            f"the blocks of {folding.fold.path} look identical but offer different shardings: plan with fold=False"
        )
    if found.unruled:
        warnings.warn(
            f"autotp: {len(found.unruled)} op(s) on the weights' path run replicated (correct, possibly "
            f"slower): {'; '.join(f'{op}: {why}' for op, why in sorted(found.unruled.items()))}",
            stacklevel=4,
        )

    def run(offer: Candidates) -> Solution:
        return solve(
            gm,
            offer,
            topo,
            options,
            sizes=sizes,
            weights=folding.weights if folding else None,
            ties=folding.ties if folding else (),
            recompute=attempt.recompute,
            imposed=imposed,
        )

    solution, experts_cost = run(found), None
    offered_experts = found.segments or any(
        isinstance(s.output, Disjoint) for found_here in found.strategies.values() for s in found_here
    )
    if offered_experts and price_experts and not options.fixed and not options.experts:
        found, solution, experts_cost = _cheapest_experts(
            found,
            solution,
            options.ep,
            lambda mode: _priced(run, candidates(gm, world_size, options, attempt.tokens, mode)),
        )
    _check_experts(found, solution.choice, options)
    return to_plan(gm, found, solution, topo, options, sizes, experts_cost, imposed)


def to_plan(
    gm: torch.fx.GraphModule,
    found: Candidates,
    solution: Solution,
    topo: Topology,
    options: PlanOptions,
    sizes: Sizes,
    experts_cost: dict[str, Any] | None,
    imposed: Imposed | None = None,
) -> Plan:
    """The solution as plan data: placements by node and parameter, the collectives, prices, styles and memory."""
    folding = gm.meta.get("autotp_fold")
    weights = folding.weights if folding else None
    world_size, training, choice = found.world, options.training, solution.choice
    recomputed = {node for core in solution.recomputed for node in core}
    # where an op keeps tokens gathered: whether the plan keeps this rank's piece and gathers it again
    gathered = {n: n in solution.regathers for n in kept_gathered(choice, needs_grad(gm))} if training else {}
    expand: Callable[[dict[Any, Any]], dict[str, Any]] = folding.fold.expand if folding else dict
    return Plan(
        world_size=world_size,
        fingerprint=folding.fingerprint(gm) if folding else fingerprint(gm),
        topology=topo.name,
        nodes={
            n.name: {
                **Plan.encode(s),
                "module": module_path(n),
                "op": target_name(n.target),
                "args": [a.name for a in input_slots(n)],
                **({"recompute": True} if n in recomputed else {}),
                **({"regather": gathered[n]} if n in gathered else {}),
                **({"key": folding.blocks.key[n]} if folding else {}),
            }
            for n, s in choice.items()
        },
        params=expand({n.target: str(s.output) for n, s in choice.items() if n.op == "get_attr"}),
        collectives=planned_collectives(
            gm,
            choice,
            world_size,
            topo,
            sizes,
            weights,
            training,
            per_reader=bool(imposed and imposed.grad_sums_per_reader),
            regathered=solution.regathers,
            coalesce=not (imposed and imposed.sums_each_param),
        ),
        styles=expand(param_styles(gm, choice, world_size)),
        quantized=expand(quantized_layout(gm)),
        shapes=expand({n.target: list(n.meta["val"].shape) for n in choice if n.op == "get_attr"}),
        alternatives=alternatives(gm, found, choice, topo, training, sizes, solution.regathers),
        cost={
            "seconds": solution.seconds,
            "compute_seconds": solution.compute,
            "async_tp": {
                "chosen": bool(options.async_tp),
                "fused": [f"{n.name}: {have} -> {want}" for n, have, want in solution.overlap],
                "saved_seconds": sum(solution.overlap.values()),
            },
            "training": training,
            "memory": {k: v for k, v in solution.memory.items() if training or k not in BACKWARD_MEMORY},
            **(
                {"regathers": [{"tensor": n.name, **priced} for n, priced in solution.regathers.items()]}
                if training
                else {}
            ),
            **_activations_by_module(gm, choice, sizes, world_size, training, solution.recomputed, solution.regathers),
            **({"experts": experts_cost} if experts_cost else {}),
            **({"replicated": dict(sorted(found.unruled.items()))} if found.unruled else {}),
        },
        replicated_ops=sorted(found.unruled),
        mesh={"tp": world_size, **({"ep": options.ep} if options.ep > 1 else {})},
        fold=(
            {
                "path": folding.fold.path,
                "count": folding.fold.count,
                **({"start": folding.fold.start} if folding.fold.start else {}),
            }
            if folding
            else None
        ),
    )


def _check_experts(found: Candidates, choice: Mapping[Node, Strategy], options: PlanOptions) -> None:
    """Experts imposed "all-to-all", or a mesh's "ep" ranks to dispatch them over, need segments that can be."""
    exits = {s.exit: s for s in found.segments.values()}
    if options.experts == "all-to-all" and not (exits and all(isinstance(choice[e].output, Routed) for e in exits)):
        raise PlanningError(
            'experts="all-to-all": no plan dispatches every expert segment (each needs at least as '
            "many experts as dispatch ranks, and ops that keep rows): choose another expert strategy"
        )
    if options.ep > 1 and not exits:
        raise PlanningError(
            f'the mesh has an "ep" dimension of {options.ep} ranks, but this model has no expert layer '
            "autotp can dispatch (grouped matmuls or w[ids] + bmm, routed rows in, one result out): "
            'drop the "ep" dimension'
        )


def _priced(run: Callable[[Candidates], Solution], found: Candidates) -> tuple[Candidates, Solution] | None:
    """(candidates, their solution), or None where no plan of them fits or dispatches as imposed."""
    try:
        return found, run(found)
    except PlanningError:
        return None


def _cheapest_experts(
    found: Candidates,
    solution: Solution,
    ep: int,
    imposed: Callable[[str], tuple[Candidates, Solution] | None],
) -> tuple[Candidates, Solution, dict[str, Any]]:
    """The cheapest of the plan solved with the expert strategy left free and the plans with each imposed (the
    free solve keeps large parameters sharded wherever a shard suits all their users, which can rule out a mix
    that an imposed strategy reaches); with how the chosen plan holds its experts (3-D parameters): whole experts
    computing their rows in place ("parallel"), whole experts fed by all-to-all ("all-to-all"), each expert split
    ("tensor"), several ("mixed") or none ("replicated"), and each strategy's estimated step time (None where
    none fits), for reports."""
    seconds: dict[str, float | None] = {}
    for mode in ("tensor", "all-to-all") if ep > 1 else ("tensor", "parallel", "all-to-all"):
        priced = imposed(mode)
        seconds[mode] = None if priced is None else priced[1].seconds
        if priced is not None and priced[1].seconds < solution.seconds * (1 - 1e-9):
            found, solution = priced
    kinds = {
        "all-to-all" if isinstance(s.output, Routed) else "parallel" if s.output.dim == 0 else "tensor"
        for n, s in solution.choice.items()
        if n.op == "get_attr" and n.meta["val"].dim() == 3 and isinstance(s.output, (Shard, Routed))
    }
    none = "all-to-all" if ep > 1 else "replicated"  # over "ep" alone: whole experts, dispatched there
    return (
        found,
        solution,
        {"chosen": kinds.pop() if len(kinds) == 1 else "mixed" if kinds else none, "seconds": seconds},
    )


def _activations_by_module(
    gm: torch.fx.GraphModule,
    choice: dict[Node, Strategy],
    sizes: Sizes | None,
    world: int,
    training: bool,
    recomputed: list[list[Node]],
    regathered: Collection[Node],
) -> dict[str, Any]:
    """Bytes kept for backward per device by the module that computes them, the modules that split
    the tokens (sequence parallelism) and those whose attention core is recomputed, for reports."""
    split = sorted({module_path(n) for n, s in choice.items() if on_tokens(n, s)})
    dropping = sorted({module_path(n) for n in choice if drops(n)})
    if not training:  # nothing is kept for a backward, nothing recomputed
        return {"token_split": split, "dropout": dropping}
    kept: dict[str, float] = {}
    for node, held in activation_bytes(choice, sizes or Sizes(), world, needs_grad(gm), recomputed, regathered).items():
        kept[module_path(node)] = kept.get(module_path(node), 0.0) + held
    return {
        "activations": kept,
        "token_split": split,
        "recompute": sorted({module_path(core[-1]) for core in recomputed}),
        "dropout": dropping,
    }
