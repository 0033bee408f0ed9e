"""What one tensor x pipeline x data (x expert) parallel layout costs, given a TP plan read per block: pure functions.

A ``Profile`` is one TP plan's time and memory per block for one sample (autotp/planning/mesh_search.py reads it
from the solved graph); ``price`` turns it into a step time and a peak memory per device for a
number of stages, replicas, micro-batches, a schedule, recomputation and an expert-parallel degree
(expert_layout.py).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field, replace

from autotp.cost_models import expert_layout as moe
from autotp.cost_models import schedule_tables as pipe
from autotp.cost_models.memory import RankMemory
from autotp.cost_models.topology import Topology

STATE = ("params", "grads", "optimizer", "buffers")
TERMS = ("parameters", "gradients", "optimizer")  # RankMemory's names of STATE's first three
KEPT = ("activations", "kv_cache")  # held per micro-batch in flight


@dataclass
class Section:
    """One block (or the embedding / head around the blocks) under a TP plan, for one sample."""

    seconds: float = 0.0  # forward + backward: compute and TP collectives
    memory: dict = field(default_factory=dict)  # bytes by kind (cost_models.memory.KINDS)
    experts: moe.Experts | None = None  # its routed experts (counted in seconds and memory too)

    def held(self, kinds=STATE) -> float:
        return sum(self.memory.get(k, 0.0) for k in kinds)


@dataclass
class Profile:
    """A TP plan read per section: ``sections[0]`` the embedding side, ``[-1]`` the head side,
    between them every real block; ``boundary``: bytes one sample passes from block to block."""

    tp: int
    sections: list
    boundary: float
    stackable: bool  # blocks found (a folded stack): pipeline stages can fall between them
    ranges: dict = field(default_factory=dict)  # (stages, ep, etp, micro-batch) -> time-balanced block ranges
    sums: dict = field(default_factory=dict)  # running totals over the blocks (stage_memory)
    sequence_parallel: bool = False  # the TP plan splits norms, dropouts and residual adds by tokens
    selective: bool = False  # the TP plan recomputes the attention cores
    async_tp: bool = False  # its token collectives priced fused with their matmuls (planning/overlap.py)
    tied: dict = field(default_factory=dict)  # bytes by kind of weights read before and after the blocks (tied
    # embeddings), counted in sections[0]: a stage holding the head without the embedding holds its own copy

    @property
    def blocks(self) -> list:
        return self.sections[1:-1]


@dataclass
class Candidate:
    tp: int
    pp: int
    dp: int
    ep: int = 1  # expert parallelism: experts dealt over ep ranks
    etp: int | None = None  # each expert split over etp ranks (tp or 1; None: tp)
    microbatches: int = 1
    microbatch_size: int = 0
    schedule: str | None = None
    virtual_stages: int = 1
    recompute: bool = False  # whole blocks recomputed (only their inputs kept)
    sequence_parallel: bool = False
    selective: bool = False  # attention cores recomputed (Korthikanti et al. 2022)
    async_tp: bool = False  # token collectives fused with their matmuls under torch.compile
    stages: list = field(default_factory=list)  # [start, end) blocks per stage (per virtual stage, in order); given
    # to price, the split it prices (else the one it chooses)
    step_seconds: float | None = None  # None: does not fit
    memory_bytes: float | None = None  # the largest of ``memory``'s totals
    memory: list = field(default_factory=list)  # RankMemory of each pipeline rank
    mfu: float | None = None
    bubble: float = 0.0  # idle share of the step: 1 - m / the schedule's stage-times
    parts: dict = field(default_factory=dict)  # step seconds by part: compute (with TP collectives), p2p,
    note: str = ""  # bubble, dp (all of it) and dp_exposed (what overlap leaves)

    @property
    def fits(self) -> bool:
        return self.step_seconds is not None


@dataclass(frozen=True)
class Setting:
    """What every layout of one request shares."""

    topology: Topology
    global_batch: int
    training: bool
    data_parallel: str  # "fsdp" or "ddp"
    limit: float  # bytes per device
    flops: float  # model FLOPs of one step (0 for inference: no MFU)
    imbalance: float = 1.0  # the busiest rank's routed rows over the uniform top-k share
    overlap: float = 0.0  # the share of all-to-all time hidden behind compute (DualPipe-like schedules)


def section_seconds(profile: Profile, layout: Candidate, setting: Setting) -> list[float]:
    """Each section's seconds (the embedding side, every block, the head side) for one sample under the layout's
    expert parallelism: its expert products in fuller groups, the all-to-alls a micro-batch pays, per sample, less
    what overlap hides."""
    tp, ep, etp, b = profile.tp, layout.ep, layout.etp or profile.tp, layout.microbatch_size or 1
    found = []
    for s in profile.sections:
        seconds = s.seconds
        if s.experts is not None and ep > 1:
            seconds += (
                moe.product_seconds(s.experts, tp, ep, etp, setting.imbalance, setting.topology) - s.experts.seconds
            )
            seconds += (
                (1 - setting.overlap)
                * moe.all_to_all_seconds(s.experts, b, tp, ep, etp, setting.imbalance, setting.topology)
                / b
            )
        found.append(seconds)
    return found


def price(profile: Profile, layout: Candidate, setting: Setting) -> Candidate:
    """``layout`` (tp, pp, dp, ep, micro-batch size, schedule, virtual stages, recomputation, and its stages' block
    ranges where given) priced: its stage boundaries, step time and MFU, each pipeline rank's memory by term, or a
    note when the peak per device is over the limit."""
    pp, dp, b, v, topo = layout.pp, layout.dp, layout.microbatch_size, layout.virtual_stages, setting.topology
    m = setting.global_batch // dp // b
    costs = section_seconds(profile, layout, setting)
    ranges = (
        [tuple(r) for r in layout.stages]  # a split the runtime was given or chose
        or stage_ranges(profile, layout, setting, costs)
        or profile.ranges[_key(layout)]  # none fits: time-balanced
    )
    n = len(profile.blocks)
    chunk = []
    for start, end in ranges:  # a recomputed block runs its forward twice: 4/3 of forward + backward
        blocks = sum(costs[1 + start : 1 + end]) * (4 / 3 if layout.recompute else 1.0)
        ends = (costs[0] if start == 0 else 0.0) + (costs[-1] if end == n else 0.0)
        chunk.append(b * (blocks + ends))
    sends = 0.0
    if pp > 1:  # an activation forward (and its gradient back), per micro-batch and virtual stage
        crosses = pipe.crosses_nodes(profile.tp, dp, topo)
        sends = (2 if setting.training else 1) * v * pipe.p2p_time(profile.boundary * b, profile.tp, crosses, topo)
    compute = max(sum(chunk[s] for s in held_by(layout, i)) for i in range(pp))
    slowest = compute + sends
    units = pipe.step_units(layout.schedule, pp, m, v)
    parts = {"compute": m * compute, "p2p": m * sends, "bubble": (units - m) * slowest, "dp": 0.0, "dp_exposed": 0.0}
    held = [
        stage_memory(profile, [ranges[s] for s in held_by(layout, i)], i, layout, m, setting.data_parallel)
        for i in range(pp)
    ]
    if setting.training:
        params, grads, expert_params, expert_grads = max((h[1:] for h in held), key=lambda h: h[1] + h[3])
        gathers = 2 * m if pp == 1 else 1
        reduce, gather = pipe.dp_sync_time(params, grads, dp, profile.tp, setting.data_parallel, gathers, topo)
        ep, etp = layout.ep, layout.etp or profile.tp
        if expert_params:  # experts sum their gradients over the ranks holding the same experts
            more = pipe.dp_sync_time(
                expert_params,
                expert_grads,
                moe.expert_dp(dp, profile.tp, ep, etp),
                ep * etp,
                setting.data_parallel,
                gathers,
                topo,
            )
            reduce, gather = reduce + more[0], gather + more[1]
        parts["dp"] = reduce + gather
        parts["dp_exposed"] = pipe.exposed_dp_time(reduce, gather, slowest * 2 / 3, m * slowest)
    seconds = units * slowest + parts["dp_exposed"]
    peak = max(h[0].total for h in held)
    priced = replace(
        layout,
        microbatches=m,
        stages=[list(r) for r in ranges],
        memory_bytes=peak,
        memory=[h[0] for h in held],
        bubble=1 - m / units,
        parts=parts,
    )
    if peak > setting.limit:
        return replace(
            priced,
            note=f"needs {peak / 1e9:.1f} GB per device, over the {setting.limit / 1e9:.1f} GB "
            "limit" + (" with any split of the blocks" if pp > 1 and v == 1 else ""),
        )
    devices = profile.tp * pp * dp
    return replace(
        priced,
        step_seconds=seconds,
        mfu=setting.flops / (devices * topo.peak_flops * seconds) if setting.flops else None,
    )


def held_by(layout: Candidate, rank: int) -> list:
    """The (virtual) stages pipeline rank ``rank`` runs under the layout's schedule (in a loop, or a V)."""
    return [s for s, r in enumerate(pipe.stage_ranks(layout.schedule, layout.pp, layout.virtual_stages)) if r == rank]


def _key(layout: Candidate) -> tuple:
    return layout.pp * layout.virtual_stages, layout.ep, layout.etp, layout.microbatch_size


def stage_ranges(profile: Profile, layout: Candidate, setting: Setting, costs: list | None = None) -> list | None:
    """[start, end) block ranges for the layout's pp x v (virtual) stages: the slowest stage as fast as each
    stage's memory (``stage_memory``) under the limit allows; None when no split fits.  Interleaved stages share
    a device with others, so their split balances time alone (``price`` then checks the devices' memory).
    ``costs``: each section's seconds under the layout (``section_seconds``)."""
    parts = layout.pp * layout.virtual_stages
    if parts == 1:
        return [(0, len(profile.blocks))]
    every = costs if costs is not None else section_seconds(profile, layout, setting)
    costs = list(every[1:-1])
    costs[0] += every[0]
    costs[-1] += every[-1]
    key = _key(layout)
    if key not in profile.ranges:
        profile.ranges[key] = pipe.balance_stages(costs, parts)
    if layout.virtual_stages > 1:
        return profile.ranges[key]
    m = setting.global_batch // layout.dp // layout.microbatch_size

    @functools.cache  # the split's search asks for the same stages many times
    def fits(stage: int, start: int, end: int) -> bool:
        return stage_memory(profile, [(start, end)], stage, layout, m, setting.data_parallel)[0].total <= setting.limit

    if all(fits(k, a, b) for k, (a, b) in enumerate(profile.ranges[key])):
        return profile.ranges[key]
    return pipe.balance_stages(costs, parts, fits)


def stage_memory(
    profile: Profile, ranges: list, stage: int, layout: Candidate, microbatches: int, data_parallel: str
) -> tuple[RankMemory, float, float, float, float]:
    """(its terms at the peak, parameter bytes, gradient bytes, and those of its experts) on a device of pipeline stage
    ``stage``, which runs the blocks of ``ranges``; the embedding comes with block 0 and the head with the last
    block.  Experts are held as the layout deals them (expert_layout.py), sharded over their own data-parallel
    ranks."""
    pp, dp, sections, sums = layout.pp, layout.dp, profile.sections, _running_sums(profile)
    tp, ep, etp = profile.tp, layout.ep, layout.etp or profile.tp
    edp = moe.expert_dp(dp, tp, ep, etp)
    ends = ([sections[0]] if ranges[0][0] == 0 else []) + (
        [sections[-1]] if ranges[-1][1] == len(profile.blocks) else []
    )

    def total(kind: str) -> float:
        return sum(sums[kind][end] - sums[kind][start] for start, end in ranges) + sum(_amount(s, kind) for s in ends)

    copies = sum(1 for start, end in ranges if end == len(profile.blocks) and start > 0)  # a head stage's own copy
    params, grads, optimizer, buffers = (total(k) + copies * profile.tied.get(k, 0.0) for k in STATE)
    params, grads, optimizer = (
        x - total("experts:" + k) for x, k in zip((params, grads, optimizer), STATE[:3], strict=True)
    )
    experts = [total("experts:" + k) if ep == 1 else total("whole experts:" + k) / (ep * etp) for k in STATE[:3]]
    mine = [sections[1 + k] for start, end in ranges for k in range(start, end)]
    if data_parallel == "ddp" or dp == 1:
        own = {"parameters": params + experts[0], "gradients": grads + experts[1], "optimizer": optimizer + experts[2]}
        gathered = (0.0, 0.0)
    elif pp == 1:  # FSDP units per block (parallel/data.py): everything sharded; the root unit (embedding, head)
        # gathered all step, its gradient whole until the end.  In the forward FSDP2 holds three blocks' worth: the
        # running block gathered, its all-gather output (kept until the next copy-out: AllGatherState) and the next
        # block's (prefetched); in the backward a block's gradient whole and the reduce-scatter input kept beside
        # it (ReduceScatterState).  Measured: tests/test_measured_memory.py
        own = {k: x / dp + e / edp for k, x, e in zip(TERMS, (params, grads, optimizer), experts, strict=True)}
        gathered = tuple(
            sum(_gathered(s, ep, etp, (kind,)) for s in ends)
            + copies * max((_gathered(s, ep, etp, (kind,)) for s in mine), default=0.0)
            for kind, copies in (("params", 3), ("grads", 2))
        )
    else:  # FSDP in a pipeline stage keeps parameters gathered and gradients whole from the first forward to the
        # last backward (reshard_after_forward=False, as torchtitan), beside the sharded copies
        own = {
            "parameters": params / dp + experts[0],
            "gradients": grads / dp + experts[1],
            "optimizer": optimizer / dp + experts[2] / edp,
        }
        gathered = (params, grads)
    blocks = sum(end - start for start, end in ranges)
    around = sum(s.held(KEPT) for s in ends)
    flight = pipe.in_flight(layout.schedule, pp, microbatches, stage, layout.virtual_stages)
    if layout.recompute and blocks:  # each block's input is kept; one block at a time is recomputed whole
        largest = max(max(sums["kept_each"][start:end]) for start, end in ranges)
        # under sequence parallelism a block's input is this rank's tokens (Korthikanti et al. 2022: 2sbh/t a layer)
        kept_input = profile.boundary / profile.tp if profile.sequence_parallel else profile.boundary
        activations = (kept_input * blocks + around) * flight + largest
    else:
        activations = (total("kept") + around) * flight
    dispatch = max(
        (
            moe.buffer_bytes(s.experts, layout.microbatch_size, tp, ep, etp, 1.0)
            for s in mine + ends
            if s.experts is not None
        ),
        default=0.0,
    )  # one layer's all-to-all at a time
    held = RankMemory(
        **own,
        gathered_parameters=gathered[0],
        gathered_gradients=gathered[1],
        activations=layout.microbatch_size * activations,
        buffers=buffers,
        dispatch=dispatch,
    )
    return held, params, grads, experts[0], experts[1]


def _gathered(section: Section, ep: int, etp: int, kinds: tuple = ("params", "grads")) -> float:
    """A block's parameters and/or gradients while FSDP has them gathered: its experts as the layout holds them."""
    held = section.held(kinds)
    if section.experts is None or ep == 1:
        return held
    return held - sum(section.experts.state.get(k, 0.0) - section.experts.whole.get(k, 0.0) / (ep * etp) for k in kinds)


def _running_sums(profile: Profile) -> dict:
    """Running totals over the blocks by kind (``kept``: what backward keeps; ``experts:KIND``: the experts' part
    of a state kind as the TP plan holds it, ``whole experts:KIND`` unsplit), so that a stage's memory costs the
    same for any number of blocks: the stage split asks for it many times."""
    if not profile.sums:
        blocks = profile.blocks
        for kind in (*STATE, *(f"{name}{k}" for name in ("experts:", "whole experts:") for k in STATE)):
            profile.sums[kind] = list(itertools.accumulate((_amount(s, kind) for s in blocks), initial=0.0))
        profile.sums["kept_each"] = [s.held(KEPT) for s in blocks]
        profile.sums["kept"] = list(itertools.accumulate(profile.sums["kept_each"], initial=0.0))
    return profile.sums


def _amount(section: Section, kind: str) -> float:
    """A section's bytes of a kind; ``experts:KIND``: its experts' part as the TP plan holds it, ``whole
    experts:KIND`` unsplit."""
    name, _, part = kind.rpartition(":")
    if not name:
        return section.memory.get(kind, 0.0)
    if section.experts is None:
        return 0.0
    return (section.experts.state if name == "experts" else section.experts.whole).get(part, 0.0)
