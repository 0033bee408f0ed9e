"""Mesh planning: tensor x pipeline x data (x expert) parallel sizes, micro-batches, schedule and stage boundaries.

One tensor-parallel plan is solved per TP size (the plan of a block does not depend on how many
stages or replicas there are) at one sample of the example inputs; its time and memory, read per
block, are then priced analytically for every pipeline / data-parallel split
(cost_models/mesh_layout.py, cost_models/schedule_tables.py).  Activations are the planner's own count: every op
output kept for backward, per block, under the chosen TP plan (or only each block's input with recomputation).
A TP size whose plain plan does not fit (or fits only recomputing whole blocks) is also planned with sequence
parallelism and with its attention cores recomputed (Korthikanti et al. 2022), each priced like any other plan.
A graph with routed experts is planned with its experts split over the TP ranks, and every expert-parallel degree
that divides the experts is priced on top of it (planning/expert_roles.py, cost_models/expert_layout.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Any, cast

import torch

from autotp.cost_models import expert_layout as moe
from autotp.cost_models import load_topology
from autotp.cost_models import schedule_tables as pipe
from autotp.cost_models.memory import memory_limit as device_limit
from autotp.cost_models.mesh_layout import Candidate, Profile, Setting, price
from autotp.cost_models.pricing import (
    model_flops,
    priced_unit,
)
from autotp.cost_models.topology import Topology
from autotp.options import SearchOptions, from_keywords
from autotp.passes.prepared_graph import prepared_graph
from autotp.planning.solution import PlanningError
from autotp.planning.tp_profiles import tp_profile
from autotp.runtime.progress import step

ACTIVATION_MODEL = (
    "activations: every op output the backward keeps, counted per block on the TP plan's graph "
    "(with sequence parallelism split by tokens, with selective recomputation without the attention "
    "cores' own tensors; with full recomputation only each block's input, plus one block recomputed)"
)


@dataclass
class MeshPlan:
    choice: Candidate
    candidates: list[Candidate]
    devices: int
    topology: str
    data_parallel: str
    global_batch: int
    activation_model: str = ACTIVATION_MODEL

    def to_dict(self) -> dict[str, Any]:
        c = self.choice
        keys = (
            "tp",
            "pp",
            "dp",
            "ep",
            "etp",
            "microbatches",
            "microbatch_size",
            "schedule",
            "virtual_stages",
            "bubble",
            "recompute",
            "sequence_parallel",
            "selective",
            "async_tp",
            "stages",
        )
        return {
            "choice": {k: getattr(c, k) for k in keys},
            "step_seconds": c.step_seconds,
            "memory_bytes": c.memory_bytes,
            "memory": [asdict(m) for m in c.memory],  # each pipeline rank's bytes by term (RankMemory)
            "mfu": c.mfu,
            "devices": self.devices,
            "topology": self.topology,
            "data_parallel": self.data_parallel,
            "global_batch": self.global_batch,
            "activation_model": self.activation_model,
            "tie_rule": TIE_RULE,
            "candidates": [asdict(x) for x in self.candidates],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)


def plan_mesh(
    model: torch.nn.Module, args: Any = None, kwargs: dict[str, Any] | None = None, **options: Any
) -> MeshPlan:
    """The fastest tp x pp x dp (x ep) layout of ``devices`` (default: all of the topology) that fits, with its
    micro-batches, schedule and stage boundaries.  ``args`` are one micro-batch's example inputs (their batch dim
    may be 1); ``options``: SearchOptions' fields (autotp/options.py).  Raises PlanningError, saying what would
    fit, when nothing does."""
    (search,) = from_keywords(options, (SearchOptions,), "plan_mesh")
    _cluster(search)  # a bad request fails before the capture
    return search_mesh(prepared_graph(model, args, kwargs, fold=True), search)


def plan_mesh_for_graph(gm: torch.fx.GraphModule, **options: Any) -> MeshPlan:
    """plan_mesh on an already captured (folded) graph."""
    (search,) = from_keywords(options, (SearchOptions,), "plan_mesh_for_graph")
    return search_mesh(gm, search)


def search_mesh(gm: torch.fx.GraphModule, search: SearchOptions) -> MeshPlan:
    topo, devices = _cluster(search)
    training, data_parallel = search.training, search.data_parallel
    unit, sizes = priced_unit(gm)
    global_batch = search.global_batch or unit
    limit = device_limit(topo, search.memory_limit)
    flops = model_flops(gm, sizes) / unit * global_batch if training else 0.0
    # TP stays inside a node (Narayanan et al. 2021 section 3.3)
    tp_sizes = [tp for tp in pipe.divisors(devices) if tp <= topo.gpus_per_node]
    profiles: list[Profile] = []
    fusings = {False: (False,), True: (True,), None: (False, True)}[search.async_tp]
    with step("planning each tensor-parallel size", total=len(tp_sizes)) as advance:
        for tp in tp_sizes:
            profiles.append(cast(Profile, tp_profile(gm, tp, topo, training, sizes, unit)))  # None only with tokens
            # asynchronous TP may make sequence parallelism the faster plan even where activations fit
            if True in fusings and tp > 1 and (p := tp_profile(gm, tp, topo, training, sizes, unit, True, False, True)):
                profiles.append(p)
            advance()
    setting = Setting(
        topo, global_batch, training, data_parallel, limit, flops, search.expert_imbalance, search.overlap_all_to_all
    )
    found = _layouts(profiles, devices, setting)
    short = sorted({c.tp for c in found if not c.fits or c.recompute}) if training else []
    if short:  # activations decide: sequence parallelism, then selective recomputation too
        variants = {tp: ((True, False), (True, True)) if tp > 1 else ((False, True),) for tp in short}
        profiles += [
            p
            for tp in short
            for tokens, cores in variants[tp]
            for fused in (fusings if tokens else (False,))
            if (p := tp_profile(gm, tp, topo, training, sizes, unit, tokens, cores, fused)) is not None
            and all(p is not q for q in profiles)  # solved once (tp_profile keeps it), listed once
        ]
        found = _layouts(profiles, devices, setting)
    if not found[0].fits:
        raise PlanningError(_advice(found, profiles, devices, setting))
    return MeshPlan(found[0], found, devices, topo.name, data_parallel, global_batch)


def price_layout(gm: torch.fx.GraphModule, layout: Candidate, **options: Any) -> Candidate:
    """``layout`` (tp, pp, dp, micro-batch size, schedule, virtual stages, recomputation) priced as plan_mesh prices
    its candidates, on an already captured (folded) graph: its stages, step time and memory per device (a note
    instead of a step time when that is over the limit).  What a runtime layout is promised, to compare with it.
    ``options``: SearchOptions' fields but ``devices`` (the layout's)."""
    (search,) = from_keywords(options, (SearchOptions,), "price_layout")
    search = replace(search, devices=layout.tp * layout.pp * layout.dp)
    topo, _ = _cluster(search)
    training, data_parallel, memory_limit = search.training, search.data_parallel, search.memory_limit
    unit, sizes = priced_unit(gm)
    global_batch = search.global_batch or unit
    limit = device_limit(topo, memory_limit)
    flops = model_flops(gm, sizes) / unit * global_batch if training else 0.0
    profile = tp_profile(
        gm, layout.tp, topo, training, sizes, unit, layout.sequence_parallel, layout.selective, layout.async_tp
    )
    if profile is None:
        raise PlanningError("the graph has no tokens to split: price the layout without sequence_parallel")
    return price(profile, layout, Setting(topo, global_batch, training, data_parallel, limit, flops))


def _cluster(search: SearchOptions) -> tuple[Topology, int]:
    """The topology and device count of a request, checked."""
    topo = load_topology(search.topology, search.nodes)
    devices = search.devices or topo.devices
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive integer, got {devices!r}")
    if devices > topo.devices:
        raise ValueError(
            f"{devices} devices do not fit topology {topo.name} ({topo.devices} devices): "
            f"give nodes={math.ceil(devices / topo.gpus_per_node)} (--nodes) or a larger topology"
        )
    return topo, devices


# Step times this close (relative) are within the cost model's error: the layout with fewer pipeline stages (then
# more TP inside the node) is chosen, as Narayanan et al. 2021 (section 3.3) advise -- TP up to a node, then PP.
TIE = 0.01
TIE_RULE = (
    f"among the layouts that fit and whose step is within {TIE:.0%} of the fastest estimate (closer than the cost "
    "model's error), the fewest pipeline stages, then the most TP (Narayanan et al. 2021, section 3.3)"
)


def _layouts(profiles: list[Profile], devices: int, setting: Setting) -> list[Candidate]:
    """The best layout per (tp, pp, dp, ep, etp) over the profiles (plain, sequence parallel, ...), fastest fitting
    first."""
    found = [c for p in profiles if devices % p.tp == 0 for c in _best_layout(p, devices, setting)]
    best: dict[tuple[int | None, ...], Candidate] = {}
    for c in sorted(found, key=lambda c: (not c.fits, c.step_seconds or 0.0, c.memory_bytes or math.inf)):
        best.setdefault((c.tp, c.pp, c.dp, c.ep, c.etp), c)
    ranked = list(best.values())
    if ranked and ranked[0].fits:  # estimates within TIE of the fastest are a tie: fewer pipeline stages win
        fastest = cast(float, ranked[0].step_seconds)  # it fits
        close = [c for c in ranked if c.fits and cast(float, c.step_seconds) <= fastest * (1 + TIE)]
        chosen = min(close, key=lambda c: (c.pp, -c.tp, c.step_seconds))
        ranked.remove(chosen)
        ranked.insert(0, chosen)
    return ranked


def _best_layout(profile: Profile, devices: int, setting: Setting) -> list[Candidate]:
    """For each pp (and so dp) and expert-parallel degree at this TP size: the fastest micro-batching, schedule
    and recomputation that fits, or the one needing the least memory, whose note says why it does not fit."""
    found = []
    rest = devices // profile.tp
    stages_max = len(profile.blocks) if profile.stackable else 1
    experts = next((s.experts for s in profile.sections if s.experts is not None), None)
    for pp in (p for p in pipe.divisors(rest) if p <= stages_max):
        dp = rest // pp
        per_replica = setting.global_batch // dp
        if setting.global_batch % dp:
            found.append(
                Candidate(
                    profile.tp, pp, dp, note=f"global batch {setting.global_batch} does not divide by {dp} replicas"
                )
            )
            continue
        for ep, etp in moe.options(experts, profile.tp, dp):
            options = [
                price(
                    profile,
                    Candidate(
                        profile.tp,
                        pp,
                        dp,
                        ep,
                        etp,
                        microbatch_size=b,
                        schedule=schedule,
                        virtual_stages=v,
                        recompute=recompute,
                        sequence_parallel=profile.sequence_parallel,
                        selective=profile.selective,
                        async_tp=profile.async_tp,
                    ),
                    setting,
                )
                for b in pipe.powers_of_two_dividing(per_replica, 16)
                for schedule, v in _schedules(pp, per_replica // b, len(profile.blocks))
                for recompute in ((False, True) if setting.training and profile.stackable else (False,))
            ]
            fitting = [c for c in options if c.fits]
            found.append(
                min(fitting, key=lambda c: (c.step_seconds, c.memory_bytes))
                if fitting
                else min(options, key=lambda c: cast(float, c.memory_bytes))
            )
    return found


# what the runtime runs (parallel/schedules.py): PyTorch's schedules by name, with their stages per rank
SCHEDULES = (
    ("GPipe", 1),
    ("1F1B", 1),
    ("Interleaved1F1B", 2),
    ("Interleaved1F1B", 4),
    ("InterleavedZeroBubble", 2),
    ("InterleavedZeroBubble", 4),
    ("ZBVZeroBubble", 2),
    ("DualPipeV", 2),
)


def _schedules(pp: int, microbatches: int, blocks: int) -> list[tuple[str | None, int]]:
    """The schedules (and stages per rank) that run ``microbatches`` on ``pp`` ranks of ``blocks`` blocks; several
    stages per rank only with whole rounds of micro-batches (a multiple of pp), which every such schedule runs."""
    if pp == 1:
        return [(None, 1)]
    return [
        (name, v)
        for name, v in SCHEDULES
        if blocks >= pp * v and (v == 1 or microbatches % pp == 0) and _runs(name, pp, v, microbatches)
    ]


def _runs(name: str, pp: int, virtual: int, microbatches: int) -> bool:
    try:
        pipe.action_table(
            pipe.schedule_class(name), pp, virtual, pipe.simulated_microbatches(pp, microbatches, virtual)
        )
    except ValueError:  # the schedule's own rule (1F1B, DualPipeV: at least as many micro-batches as stages, ...)
        return False
    return True


def _advice(candidates: list[Candidate], profiles: list[Profile], devices: int, setting: Setting) -> str:
    """Why nothing fits (the leanest layout's need) and what would: FSDP instead of DDP, or more devices."""
    topo = setting.topology
    least = min(
        (c for c in candidates if c.memory_bytes is not None), key=lambda c: cast(float, c.memory_bytes), default=None
    )
    if least is None or least.memory_bytes is None:
        return "no layout of the devices divides the global batch: " + "; ".join(sorted({c.note for c in candidates}))
    found = (
        f"nothing fits {setting.limit / 1e9:.1f} GB per device on {devices} devices of {topo.name}: the "
        f"leanest layout ({layout_name(least)}, micro-batch {least.microbatch_size}"
        f"{activation_options(least)}) needs {least.memory_bytes / 1e9:.1f} GB"
    )
    hints = []
    if setting.data_parallel == "ddp":
        fsdp = _layouts(profiles, devices, dataclasses.replace(setting, data_parallel="fsdp"))[0]
        if fsdp.fits:
            hints.append(f"data_parallel='fsdp' fits as {layout_name(fsdp)}")
    for factor in (2, 4, 8, 16, 32, 64):
        more = devices * factor
        bigger = load_topology(topo, max(topo.nodes, math.ceil(more / topo.gpus_per_node)))
        best = _layouts(profiles, more, dataclasses.replace(setting, topology=bigger))[0]
        if best.fits:
            hints.append(f"{more} devices (nodes={bigger.nodes}) fit as {layout_name(best)}{activation_options(best)}")
            break
    hints.append("a smaller global batch or shorter sequences need less")
    return found + "; " + "; ".join(hints)


def layout_name(c: Candidate) -> str:
    """TP t x PP p x DP d, with the expert-parallel degree where experts are dealt out."""
    experts = f" x EP {c.ep}" + (" (whole experts)" if c.etp == 1 and c.tp > 1 else "") if c.ep > 1 else ""
    return f"TP {c.tp} x PP {c.pp} x DP {c.dp}{experts}"


def activation_options(c: Candidate) -> str:
    """How a layout saves activation memory (and, fused, collective time), for messages."""
    return "".join(
        [
            ", sequence parallel" * c.sequence_parallel,
            " with asynchronous TP" * c.async_tp,
            ", recomputing attention" * c.selective,
            ", recomputing activations" * c.recompute,
        ]
    )
