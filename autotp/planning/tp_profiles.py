"""A TP size's plan read as a mesh planner needs it: solved once per TP size and option (sequence parallelism,
recomputed cores), its time and memory per block section, per sample, kept on the graph for other clusters."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, cast

import torch

from autotp.cost_models.mesh_layout import Profile, Section
from autotp.cost_models.pricing import (
    Sizes,
    activation_bytes,
    op_memory,
    op_seconds,
    read_at_both_ends,
)
from autotp.cost_models.topology import Topology
from autotp.ops.strategies import Strategy, needs_grad
from autotp.options import PlanOptions
from autotp.passes.fold import sections
from autotp.passes.recompute import attention_cores
from autotp.placement import parse
from autotp.planning.expert_roles import block_experts, expert_part
from autotp.planning.solution import Imposed, PlanningError, every_name
from autotp.planning.tensor_plan import solve_plan


def tp_profile(
    gm: torch.fx.GraphModule,
    tp: int,
    topo: Topology,
    training: bool,
    sizes: Sizes,
    unit: int,
    tokens: bool = False,
    cores: bool = False,
    fused: bool = False,
) -> Profile | None:
    """Solve the TP plan once and read its time and memory per section, per sample (kept on the graph:
    pricing another cluster of the same nodes reuses it).  ``tokens``: with sequence parallelism;
    ``cores``: recomputing the attention cores; ``fused``: token collectives priced fused with their matmuls
    (asynchronous TP, only with ``tokens``); None when the graph has no tokens to split."""
    fused = fused and tokens
    key = (tp, training, tokens, cores, fused, repr(dataclasses.replace(topo, name="", nodes=1)))
    cache = gm.meta.setdefault("autotp_tp_profiles", {})
    if key not in cache:
        try:
            cache[key] = _read_profile(gm, tp, topo, training, sizes, unit, tokens, cores, fused)
        except PlanningError:
            if not tokens:
                raise
            cache[key] = None
    return cast("Profile | None", cache[key])


def _read_profile(
    gm: torch.fx.GraphModule,
    tp: int,
    topo: Topology,
    training: bool,
    sizes: Sizes,
    unit: int,
    tokens: bool,
    cores: bool,
    fused: bool,
) -> Profile:
    part = expert_part(gm, topo, sizes) if training else None
    # the mesh planner adds sequence parallelism where activations decide: its lean form, each gathered token tensor
    # kept as this rank's piece and gathered again (Megatron-SP); the layout's own TP plan chooses under its limit
    lean = Imposed(regathered=every_name(gm)) if tokens else None
    plan = solve_plan(
        gm,
        tp,
        PlanOptions(
            topology=topo,
            training=training,
            memory_limit=math.inf,
            sequence_parallel=tokens,
            recompute="selective" if cores else False,
            experts="tensor" if part else None,
            async_tp=fused,
        ),
        sizes=sizes,
        imposed=lean,
    )
    where, blocks, fold = sections(gm)
    count = cast(int, blocks)  # a block count where the graph is folded (fold), unread otherwise
    nodes = {n.name: n for n in gm.graph.nodes}
    trainable = dict(gm.named_parameters(remove_duplicate=False))
    kept: dict[Any, Section] = {}
    choice = {
        nodes[name]: Strategy(tuple(parse(p) for p in entry["in"]), parse(entry["out"]))
        for name, entry in plan.nodes.items()
    }
    tied: dict[str, float] = {}
    both = read_at_both_ends(where)
    for node, strategy in choice.items():
        section = kept.setdefault(where[node], Section())
        section.seconds += op_seconds(node, strategy, sizes, tp, topo, training)
        for kind, held in op_memory(node, strategy, sizes, tp, trainable, training).items():
            section.memory[kind] = section.memory.get(kind, 0.0) + held
            if node in both:
                tied[kind] = tied.get(kind, 0.0) + held
    grad = needs_grad(gm) if training else set()
    again = [core for core in attention_cores(gm, grad) if plan.nodes.get(core[-1].name, {}).get("recompute")]
    regathered = {node for node in choice if plan.regathers(node.name)}
    for node, held in activation_bytes(choice, sizes, tp, grad, again, regathered).items():
        section = kept.setdefault(where[node], Section())
        section.memory["activations"] = section.memory.get("activations", 0.0) + held
    for c in plan.collectives:
        kept.setdefault(where[nodes[c["tensor"]]], Section()).seconds += c["seconds"]
    order = ["pre", *([fold.rep(i) for i in range(count)] if fold else []), "post"]
    parts = [kept.get(key, Section()) for key in order]
    total = sum(s.seconds for s in parts)
    scale = plan.cost["seconds"] / total if total else 1.0  # the solver's total; the split follows each section's
    experts = block_experts(part, choice, where, sizes, tp, topo, training, trainable, unit, scale) if part else {}
    per_sample = [
        Section(
            s.seconds * scale / unit,
            {k: (v / unit if k in ("activations", "kv_cache") else v) for k, v in s.memory.items()},
            experts.get(key),
        )
        for key, s in zip(order, parts, strict=True)
    ]
    boundary = 0.0
    if fold:  # tensors the middle block hands to the next kept block (N-2): what a stage sends to the next
        boundary = (
            sum(
                sizes.nbytes(n)
                for n in gm.graph.nodes
                if where[n] == fold.first and any(where.get(u) == count - 2 for u in n.users)
            )
            / unit
        )
    return Profile(
        tp, per_sample, boundary, fold is not None, sequence_parallel=tokens, selective=cores, async_tp=fused, tied=tied
    )
