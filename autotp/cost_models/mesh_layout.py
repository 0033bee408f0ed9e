"""What one tensor x pipeline x data parallel layout costs, given a TP plan read per block: pure functions.

A ``Profile`` is one TP plan's time and memory per block for one sample (autotp/mesh_planner.py reads it
from the solved graph); ``price`` turns it into a step time and a peak memory per device for a
number of stages, replicas, micro-batches, a schedule and recomputation.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from . import schedules as pipe
from .topology import Topology

STATE = ("params", "grads", "optimizer", "buffers")
KEPT = ("activations", "kv_cache")  # held per micro-batch in flight


@dataclass
class Section:
    """One block (or the embedding / head around the blocks) under a TP plan, for one sample."""
    seconds: float = 0.0                          # forward + backward: compute and TP collectives
    memory: dict = field(default_factory=dict)    # bytes by kind (cost_models.memory.KINDS)

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
    ranges: dict = field(default_factory=dict)  # stage count -> time-balanced [start, end) block ranges
    sums: dict = field(default_factory=dict)    # running totals over the blocks (stage_memory)
    sequence_parallel: bool = False  # the TP plan splits norms, dropouts and residual adds by tokens
    selective: bool = False          # the TP plan recomputes the attention cores
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
    microbatches: int = 1
    microbatch_size: int = 0
    schedule: str | None = None
    virtual_stages: int = 1
    recompute: bool = False                     # whole blocks recomputed (only their inputs kept)
    sequence_parallel: bool = False
    selective: bool = False                     # attention cores recomputed (Korthikanti et al. 2022)
    stages: list = field(default_factory=list)  # [start, end) blocks per stage (per virtual stage, in order)
    step_seconds: float | None = None           # None: does not fit
    memory_bytes: float | None = None
    mfu: float | None = None
    bubble: float = 0.0                         # idle share of the step: 1 - m / the schedule's stage-times
    parts: dict = field(default_factory=dict)   # step seconds by part: compute (with TP collectives), p2p,
    note: str = ""                              # bubble, dp (all of it) and dp_exposed (what overlap leaves)

    @property
    def fits(self) -> bool:
        return self.step_seconds is not None


@dataclass(frozen=True)
class Setting:
    """What every layout of one request shares."""
    topology: Topology
    global_batch: int
    training: bool
    data_parallel: str   # "fsdp" or "ddp"
    limit: float         # bytes per device
    flops: float         # model FLOPs of one step (0 for inference: no MFU)


def price(profile: Profile, layout: Candidate, setting: Setting) -> Candidate:
    """``layout`` (tp, pp, dp, micro-batch size, schedule, virtual stages, recomputation) priced: its
    stage boundaries, step time and MFU, or a note when its peak memory per device is over the limit."""
    pp, dp, b, v, topo = layout.pp, layout.dp, layout.microbatch_size, layout.virtual_stages, setting.topology
    m = setting.global_batch // dp // b
    ranges = stage_ranges(profile, layout, setting) or profile.ranges[pp * v]  # none fits: the time-balanced one
    n, sections = len(profile.blocks), profile.sections
    chunk = []
    for start, end in ranges:  # a recomputed block runs its forward twice: 4/3 of forward + backward
        blocks = sum(s.seconds for s in sections[1 + start:1 + end]) * (4 / 3 if layout.recompute else 1.0)
        ends = (sections[0].seconds if start == 0 else 0.0) + (sections[-1].seconds if end == n else 0.0)
        chunk.append(b * (blocks + ends))
    sends = 0.0
    if pp > 1:  # an activation forward (and its gradient back), per micro-batch and virtual stage
        crosses = pipe.crosses_nodes(profile.tp, dp, topo)
        sends = (2 if setting.training else 1) * v * pipe.p2p_time(profile.boundary * b, profile.tp, crosses, topo)
    compute = max(sum(chunk[s] for s in held_by(layout, i)) for i in range(pp))
    slowest = compute + sends
    units = pipe.step_units(layout.schedule, pp, m, v)
    parts = {"compute": m * compute, "p2p": m * sends, "bubble": (units - m) * slowest, "dp": 0.0, "dp_exposed": 0.0}
    held = [stage_memory(profile, [ranges[s] for s in held_by(layout, i)], i, layout, m, setting.data_parallel)
            for i in range(pp)]
    if setting.training:
        params, grads = max(((h[1], h[2]) for h in held), key=lambda h: h[1])
        reduce, gather = pipe.dp_sync_time(params, grads, dp, profile.tp, setting.data_parallel,
                                           2 * m if pp == 1 else 1, topo)
        parts["dp"] = reduce + gather
        parts["dp_exposed"] = pipe.exposed_dp_time(reduce, gather, slowest * 2 / 3, m * slowest)
    seconds = units * slowest + parts["dp_exposed"]
    peak = max(h[0] for h in held)
    priced = replace(layout, microbatches=m, stages=[list(r) for r in ranges], memory_bytes=peak,
                     bubble=1 - m / units, parts=parts)
    if peak > setting.limit:
        return replace(priced, note=f"needs {peak / 1e9:.1f} GB per device, over the {setting.limit / 1e9:.1f} GB "
                                    "limit" + (" with any split of the blocks" if pp > 1 and v == 1 else ""))
    devices = profile.tp * pp * dp
    return replace(priced, step_seconds=seconds,
                   mfu=setting.flops / (devices * topo.peak_flops * seconds) if setting.flops else None)


def held_by(layout: Candidate, rank: int) -> list:
    """The (virtual) stages pipeline rank ``rank`` runs under the layout's schedule (in a loop, or a V)."""
    return [s for s, r in enumerate(pipe.stage_ranks(layout.schedule, layout.pp, layout.virtual_stages)) if r == rank]


def stage_ranges(profile: Profile, layout: Candidate, setting: Setting) -> list | None:
    """[start, end) block ranges for the layout's pp x v (virtual) stages: the slowest stage as fast as each
    stage's memory (``stage_memory``) under the limit allows; None when no split fits.  Interleaved stages share
    a device with others, so their split balances time alone (``price`` then checks the devices' memory)."""
    parts = layout.pp * layout.virtual_stages
    if parts == 1:
        return [(0, len(profile.blocks))]
    costs = [s.seconds for s in profile.blocks]
    costs[0] += profile.sections[0].seconds
    costs[-1] += profile.sections[-1].seconds
    if parts not in profile.ranges:
        profile.ranges[parts] = pipe.balance_stages(costs, parts)
    if layout.virtual_stages > 1:
        return profile.ranges[parts]
    m = setting.global_batch // layout.dp // layout.microbatch_size

    def fits(stage: int, start: int, end: int) -> bool:
        return stage_memory(profile, [(start, end)], stage, layout, m, setting.data_parallel)[0] <= setting.limit

    if all(fits(k, a, b) for k, (a, b) in enumerate(profile.ranges[parts])):
        return profile.ranges[parts]
    return pipe.balance_stages(costs, parts, fits)


def stage_memory(profile: Profile, ranges: list, stage: int, layout: Candidate, microbatches: int,
                 data_parallel: str) -> tuple[float, float, float]:
    """(peak bytes, parameter bytes, gradient bytes) on a device of pipeline stage ``stage``, which runs
    the blocks of ``ranges``; the embedding comes with block 0 and the head with the last block."""
    pp, dp, sections, sums = layout.pp, layout.dp, profile.sections, _running_sums(profile)
    ends = ([sections[0]] if ranges[0][0] == 0 else []) + ([sections[-1]] if ranges[-1][1] == len(profile.blocks)
                                                           else [])

    def total(kind: str) -> float:
        return sum(sums[kind][end] - sums[kind][start] for start, end in ranges)

    copies = sum(1 for start, end in ranges if end == len(profile.blocks) and start > 0)  # a head stage's own copy
    params, grads, optimizer, buffers = (total(k) + sum(s.memory.get(k, 0.0) for s in ends)
                                         + copies * profile.tied.get(k, 0.0) for k in STATE)
    if data_parallel == "ddp" or dp == 1:
        state = params + grads + optimizer
    elif pp == 1:  # FSDP units per block (parallel/data.py): everything sharded; the root unit (embedding, head)
        # gathered all step, its gradient whole until the end; a block's parameters gathered while it runs with the
        # next one's prefetched, its gradient whole until reduce-scattered
        mine = [sections[1 + k] for start, end in ranges for k in range(start, end)]
        block_params = max((s.memory.get("params", 0.0) for s in mine), default=0.0)
        block_grads = max((s.memory.get("grads", 0.0) for s in mine), default=0.0)
        root = sum(s.held(("params", "grads")) for s in ends)
        state = (params + grads + optimizer) / dp + root + 2 * block_params + block_grads
    else:  # FSDP in a pipeline stage keeps parameters gathered and gradients whole from the first forward to the
        # last backward (reshard_after_forward=False, as torchtitan), beside the sharded copies
        state = params + grads + (params + grads + optimizer) / dp
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
    return state + buffers + layout.microbatch_size * activations, params, grads


def _running_sums(profile: Profile) -> dict:
    """Running totals over the blocks by kind (``kept``: what backward keeps), so that a stage's memory costs the
    same for any number of blocks: the stage split asks for it many times."""
    if not profile.sums:
        blocks = profile.blocks
        for kind in STATE:
            profile.sums[kind] = list(itertools.accumulate((s.memory.get(kind, 0.0) for s in blocks), initial=0.0))
        profile.sums["kept_each"] = [s.held(KEPT) for s in blocks]
        profile.sums["kept"] = list(itertools.accumulate(profile.sums["kept_each"], initial=0.0))
    return profile.sums
