"""What one tensor x pipeline x data parallel layout costs, given a TP plan read per block: pure functions.

A ``Profile`` is one TP plan's time and memory per block for one sample (autotp/mesh.py reads it
from the solved graph); ``price`` turns it into a step time and a peak memory per device for a
number of stages, replicas, micro-batches, a schedule and recomputation.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from . import pipeline as pipe
from .topology import Topology

STATE = ("params", "grads", "optimizer", "buffers")


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
    ranges: dict = field(default_factory=dict)  # stage count -> balanced [start, end) block ranges

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
    recompute: bool = False
    stages: list = field(default_factory=list)  # [start, end) blocks per stage (per virtual stage, in order)
    step_seconds: float | None = None           # None: does not fit
    memory_bytes: float | None = None
    mfu: float | None = None
    bubble: float = 0.0                         # idle fraction of the schedule: (p - 1) / (v m)
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
    ranges = stage_ranges(profile, pp * v)
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
    compute = max(sum(chunk[i::pp]) for i in range(pp))
    slowest = compute + sends
    units = pipe.step_units(layout.schedule, pp, m, v)
    parts = {"compute": m * compute, "p2p": m * sends, "bubble": (units - m) * slowest, "dp": 0.0, "dp_exposed": 0.0}
    held = [stage_memory(profile, ranges[i::pp], i, layout, m, setting.data_parallel) for i in range(pp)]
    if setting.training:
        params, grads = max(((h[1], h[2]) for h in held), key=lambda h: h[1])
        reduce, gather = pipe.dp_sync_time(params, grads, dp, profile.tp, setting.data_parallel,
                                           2 * m if pp == 1 else 1, topo)
        parts["dp"] = reduce + gather
        parts["dp_exposed"] = pipe.exposed_dp_time(reduce, gather, slowest * 2 / 3, m * slowest)
    seconds = units * slowest + parts["dp_exposed"]
    peak = max(h[0] for h in held)
    priced = replace(layout, microbatches=m, stages=[list(r) for r in ranges], memory_bytes=peak,
                     bubble=(pp - 1) / (v * m) if pp > 1 else 0.0, parts=parts)
    if peak > setting.limit:
        return replace(priced, note=f"needs {peak / 1e9:.1f} GB per device, over the {setting.limit / 1e9:.1f} GB "
                                    "limit")
    devices = profile.tp * pp * dp
    return replace(priced, step_seconds=seconds,
                   mfu=setting.flops / (devices * topo.peak_flops * seconds) if setting.flops else None)


def stage_ranges(profile: Profile, parts: int) -> list:
    """Balanced [start, end) block ranges for ``parts`` (virtual) stages, kept on the profile."""
    if parts == 1:
        return [(0, len(profile.blocks))]
    if parts not in profile.ranges:
        costs = [s.seconds for s in profile.blocks]
        costs[0] += profile.sections[0].seconds
        costs[-1] += profile.sections[-1].seconds
        profile.ranges[parts] = pipe.balance_stages(costs, parts)
    return profile.ranges[parts]


def stage_memory(profile: Profile, ranges: list, stage: int, layout: Candidate, microbatches: int,
                 data_parallel: str) -> tuple[float, float, float]:
    """(peak bytes, parameter bytes, gradient bytes) on a device of pipeline stage ``stage``, which runs
    the blocks of ``ranges``; the embedding comes with block 0 and the head with the last block."""
    pp, dp, sections = layout.pp, layout.dp, profile.sections
    mine = [sections[1 + k] for start, end in ranges for k in range(start, end)]
    ends = ([sections[0]] if ranges[0][0] == 0 else []) + ([sections[-1]] if ranges[-1][1] == len(profile.blocks)
                                                           else [])
    params, grads, optimizer, buffers = (sum(s.memory.get(k, 0.0) for s in mine + ends) for k in STATE)
    if data_parallel == "ddp" or dp == 1:
        state = params + grads + optimizer
    elif pp == 1:  # FSDP: all sharded, one block's parameters and gradients gathered at a time
        state = (params + grads + optimizer) / dp + max((s.held(("params", "grads")) for s in mine + ends), default=0)
    else:  # FSDP under a pipeline keeps parameters and gradients gathered across micro-batches (torchtitan)
        state = params + grads + optimizer / dp
    kept = [s.held(("activations", "kv_cache")) for s in mine]
    around = sum(s.held(("activations", "kv_cache")) for s in ends)
    flight = pipe.in_flight(layout.schedule, pp, microbatches, stage, layout.virtual_stages)
    if layout.recompute and kept:  # each block's input is kept; one block at a time is recomputed whole
        activations = (profile.boundary * len(kept) + around) * flight + max(kept)
    else:
        activations = (sum(kept) + around) * flight
    return state + buffers + layout.microbatch_size * activations, params, grads
