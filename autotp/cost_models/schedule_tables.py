"""Pipeline and data-parallel pricing on top of a tensor-parallel plan: pure functions.

A schedule is priced by running its own action table (PyTorch's ``pipeline_order``: each pipeline rank's
forwards "F", whole backwards "B", and for zero-bubble schedules input-gradient "I" and weight-gradient "W"
passes, in the order the rank runs them) on a clock: an action starts when its rank is free and what it needs
is done (the previous stage's forward of its micro-batch, the next stage's input gradient), plus a send when
that ran on another rank.  The same run counts what each rank holds: a micro-batch's activations of a stage
from its forward until its backward ("B", or "W" after "I") is done.  GPipe and 1F1B come out at
``m + p - 1`` stage-times with ``min(p - i, m)`` micro-batches in flight on stage ``i``, interleaved 1F1B at
about ``m + (p - 1) / v`` (Narayanan et al. 2021 section 2.2), zero-bubble schedules with less (Qi et al. 2024).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass

from autotp.cost_models.communication import collective_time
from autotp.cost_models.topology import Topology

PASSES = ("F", "B", "I", "W")  # forward, whole backward, backward to the inputs, backward to the weights
LEGACY = {"interleaved-1f1b": "Interleaved1F1B"}  # names autotp used before it took PyTorch's
EXACT_MICROBATCHES = 16  # longer tables (and longer than two rounds of every stage) are extended by their steady state


def schedule_class(name) -> type:
    """PyTorch's schedule class for ``name``, case-insensitive as ``get_schedule_class`` (also "interleaved-1f1b");
    a class is its own."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    return name if isinstance(name, type) else get_schedule_class(LEGACY.get(name.lower(), name))


@dataclass(frozen=True)
class Table:
    """A schedule's compute actions: ``order[rank]`` the (stage, pass, micro-batch) a pipeline rank runs, in
    order; ``rank_of[stage]`` the rank that holds each stage."""

    order: dict
    rank_of: tuple


class _Stage:
    """What a schedule's constructor reads of a stage: enough to make it compute its table, without a process
    group or a module."""

    def __init__(self, index: int, stages: int, pp: int):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, stages, pp, 0
        self.is_first, self.is_last, self.submod = index == 0, index == stages - 1, None


@functools.lru_cache(maxsize=512)
def action_table(schedule: type, pp: int, per_rank: int, microbatches: int) -> Table:
    """``schedule``'s own table for ``pp`` ranks holding ``per_rank`` stages each and ``microbatches``: its
    constructor computes it (and raises its ValueError for a count it cannot run)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, ScheduleGPipe

    stages = pp * per_rank
    single = issubclass(schedule, PipelineScheduleSingle)
    held = [_Stage(s, stages, pp) for s in range(0, stages, pp)]
    built = _table_only(schedule)(held[0] if single else held, microbatches, loss_fn=lambda output, target: output)
    if single:  # these run code, not a table (1F1B's pipeline_order, a drawing, numbers its forwards off by one)
        return Table(
            {rank: tuple(_single(rank, pp, microbatches, issubclass(schedule, ScheduleGPipe))) for rank in range(pp)},
            tuple(range(stages)),
        )
    rank_of = tuple(built.stage_index_to_group_rank[s] for s in range(stages))
    return Table({rank: tuple(_compute(built.pipeline_order[rank])) for rank in range(pp)}, rank_of)


@functools.cache
def _table_only(schedule: type) -> type:
    """``schedule`` without its lowering to send/receive actions (four fifths of its constructor, and what running
    needs, not pricing): the constructor still computes ``pipeline_order`` and, through the validation the
    lowering starts with, ``stage_index_to_group_rank``.  A schedule without these hooks is built whole."""
    if not (hasattr(schedule, "_prepare_schedule_with_comms") and hasattr(schedule, "_validate_and_set_stage_mapping")):
        return schedule

    def validate_only(self, actions, format="compute_only"):
        self._validate_and_set_stage_mapping(actions)

    return type(schedule.__name__, (schedule,), {"_prepare_schedule_with_comms": validate_only})


def _single(rank: int, pp: int, microbatches: int, gpipe: bool):
    """What GPipe and 1F1B run on ``rank``: every forward then every backward, or ``pp - rank`` forwards first
    and then a backward before each further forward (Schedule1F1B's warm-up and 1B1F phases)."""
    warmup = microbatches if gpipe else min(microbatches, pp - rank)
    yield from ((rank, "F", mb) for mb in range(warmup))
    for mb in range(microbatches):
        yield rank, "B", mb
        if warmup + mb < microbatches:
            yield rank, "F", warmup + mb


def _compute(actions) -> list:
    """The compute actions of a table row: idle slots and communication dropped, overlapped pairs in order."""
    for action in actions:
        if action is None:
            continue
        if action.sub_actions:
            yield from _compute(action.sub_actions)
        elif action.computation_type.value in PASSES:
            yield action.stage_index, action.computation_type.value, action.microbatch_index


@dataclass
class Timeline:
    seconds: float  # when the last action ends
    busy: list  # per rank: seconds spent computing
    held: list  # per rank: the peak sum of ``held[stage]`` over the micro-batches whose activations it keeps


def simulate(
    table: Table,
    forward: list,
    backward_input: list,
    backward_weight: list,
    send: float = 0.0,
    held: list | None = None,
) -> Timeline:
    """Run ``table`` with each stage's pass times (a whole backward "B" lasts input + weight); a value that
    crosses ranks arrives ``send`` seconds after it is computed.  Raises ValueError if the table deadlocks."""
    seconds = {
        "F": forward,
        "I": backward_input,
        "W": backward_weight,
        "B": [a + b for a, b in zip(backward_input, backward_weight, strict=True)],
    }
    stages, ranks = len(table.rank_of), len(table.order)
    held = held or [1.0] * stages
    done: dict = {}
    free, busy, at, keep, peak = [0.0] * ranks, [0.0] * ranks, [0] * ranks, [0.0] * ranks, [0.0] * ranks

    def ready(stage: int, kind: str, mb: int, rank: int) -> float | None:
        needs = []
        if kind == "F" and stage > 0:
            needs.append((stage - 1, "F", mb))
        elif kind in ("B", "I"):
            needs += [(stage, "F", mb)] + ([(stage + 1, "I", mb)] if stage + 1 < stages else [])
        elif kind == "W":
            needs.append((stage, "I", mb))
        start = free[rank]
        for need in needs:
            if need not in done:
                return None
            start = max(start, done[need] + (send if table.rank_of[need[0]] != rank else 0.0))
        return start

    remaining = sum(len(row) for row in table.order.values())
    while remaining:
        progress = False
        for rank, row in table.order.items():
            while at[rank] < len(row):
                stage, kind, mb = row[at[rank]]
                start = ready(stage, kind, mb, rank)
                if start is None:
                    break
                free[rank] = start + seconds[kind][stage]
                busy[rank] += seconds[kind][stage]
                done[(stage, kind, mb)] = free[rank]
                if kind == "B":
                    done[(stage, "I", mb)] = done[(stage, "W", mb)] = free[rank]
                keep[rank] += held[stage] if kind == "F" else -held[stage] if kind in ("B", "W") else 0.0
                peak[rank] = max(peak[rank], keep[rank])
                at[rank] += 1
                remaining -= 1
                progress = True
        if not progress:
            stuck = {rank: row[at[rank]] for rank, row in table.order.items() if at[rank] < len(row)}
            raise ValueError(f"the schedule's table deadlocks: each rank waits at {stuck}")
    return Timeline(max(free), busy, peak)


def simulated_microbatches(pp: int, microbatches: int, virtual: int) -> int:
    """The micro-batches a long step's table is run at: ``microbatches``, or beyond EXACT_MICROBATCHES (and two
    rounds of every stage) a multiple of ``pp`` below it, which every schedule accepts."""
    cap = max(EXACT_MICROBATCHES, 2 * pp * virtual)
    return microbatches if microbatches <= cap else cap - cap % pp


@functools.lru_cache(maxsize=1024)
def _uniform(name: str, pp: int, microbatches: int, virtual: int) -> tuple[float, tuple]:
    """(stage-times, micro-batches in flight per rank) of a step whose passes last alike (F = I = W: a matmul's
    forward, input gradient and weight gradient cost the same), in units of one micro-batch through a rank's
    stages; a table longer than EXACT_MICROBATCHES is run at fewer and extended by its steady state, one
    stage-time per micro-batch (GPipe-like schedules keep every micro-batch in flight: those grow too)."""
    exact = simulated_microbatches(pp, microbatches, virtual)
    table = action_table(schedule_class(name), pp, virtual, exact)
    ones = [1.0] * (pp * virtual)
    run = simulate(table, ones, ones, ones)
    extra = microbatches - exact
    flight = tuple(h / virtual + (extra if h >= exact * virtual else 0.0) for h in run.held)
    return run.seconds / (3 * virtual) + extra, flight


def step_units(schedule: str | None, pp: int, microbatches: int, virtual: int) -> float:
    """Stage-times one step lasts: the micro-batches plus the schedule's bubble."""
    if pp == 1 or schedule is None:
        return float(microbatches)
    return _uniform(schedule, pp, microbatches, virtual)[0]


def in_flight(schedule: str | None, pp: int, microbatches: int, rank: int, virtual: int) -> float:
    """How many micro-batches' activations pipeline rank ``rank`` holds at its peak (of all its stages)."""
    if pp == 1 or schedule is None:
        return 1.0
    return _uniform(schedule, pp, microbatches, virtual)[1][rank]


@functools.lru_cache(maxsize=256)
def stage_ranks(schedule: str | None, pp: int, virtual: int) -> tuple:
    """The pipeline rank of each (virtual) stage: a loop (stage s on rank s mod pp) or, for V-shaped schedules
    (ZBVZeroBubble, DualPipeV), ranks 0..pp-1 then back."""
    if pp == 1 or schedule is None:
        return (0,) * virtual
    return action_table(schedule_class(schedule), pp, virtual, 2 * pp * virtual).rank_of


def balance_stages(costs: list[float], parts: int, fits=None) -> list[tuple[int, int]] | None:
    """Contiguous ``[start, end)`` ranges of ``costs`` (one per block, the embedding's cost added to
    the first block and the head's to the last) into ``parts`` non-empty parts whose largest sum is
    as small as possible: the stage boundaries that balance stage time.

    ``fits(stage, start, end)``: whether stage ``stage`` holding blocks ``[start, end)`` fits in memory; it must
    hold for every range inside one that fits (memory grows with blocks) and for a later stage wherever it holds
    for an earlier one (GPipe and 1F1B: no more micro-batches in flight).  Then the slowest stage is as fast as
    the memory allows, and None means no split fits."""
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} blocks into {parts} pipeline stages: use at most {n} stages")
    balanced = _time_balanced(costs, parts)
    if fits is None or all(fits(k, a, b) for k, (a, b) in enumerate(balanced)):
        return balanced
    if _cut(costs, parts, fits, math.inf) is None:
        return None
    prefix = list(itertools.accumulate(costs, initial=0.0))
    fastest = max(prefix[b] - prefix[a] for a, b in balanced)  # no split is faster than the time-balanced one
    bounds = sorted(
        {prefix[b] - prefix[a] for a in range(n) for b in range(a + 1, n + 1) if prefix[b] - prefix[a] >= fastest}
    )  # the slowest stage's time is one of these
    lo, hi = 0, len(bounds)  # _cut(bounds[hi]) succeeds (math.inf when hi == len(bounds))
    while lo < hi:
        mid = (lo + hi) // 2
        if _cut(costs, parts, fits, bounds[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    return _cut(costs, parts, fits, bounds[hi] if hi < len(bounds) else math.inf)


def _time_balanced(costs: list[float], parts: int) -> list[tuple[int, int]]:
    n = len(costs)
    lo, hi = max(costs), sum(costs)
    for _ in range(60):  # the smallest largest-part sum a greedy cut achieves with at most `parts` parts
        mid = (lo + hi) / 2
        if _greedy_parts(costs, mid) <= parts:
            hi = mid
        else:
            lo = mid
    ranges, start, total = [], 0, 0.0
    for i, cost in enumerate(costs):
        left = parts - len(ranges) - 1  # parts still to open after the current one
        if i > start and (total + cost > hi or n - i == left):
            ranges.append((start, i))
            start, total = i, 0.0
        total += cost
    ranges.append((start, n))
    return ranges


def _greedy_parts(costs: list[float], limit: float) -> int:
    parts, total = 1, 0.0
    for cost in costs:
        if total and total + cost > limit:
            parts, total = parts + 1, 0.0
        total += cost
    return parts


def _cut(costs: list[float], parts: int, fits, limit: float) -> list[tuple[int, int]] | None:
    """A split whose stages each take at most ``limit`` seconds and fit in memory, or None.

    From the last stage back, each takes as many blocks as fit.  That is never worse than any other split: a
    later stage holds no more micro-batches in flight than an earlier one, so what an earlier stage could hold
    of the blocks left, the later one could too (``fits`` is monotone in the stage and in the range)."""
    prefix = list(itertools.accumulate(costs, initial=0.0))
    ranges, end = [], len(costs)
    for stage in range(parts - 1, 0, -1):
        start = end
        while start > stage and prefix[end] - prefix[start - 1] <= limit and fits(stage, start - 1, end):
            start -= 1  # leaving a block for every earlier stage
        if start == end:
            return None
        ranges.append((start, end))
        end = start
    if prefix[end] > limit or not fits(0, 0, end):
        return None
    return [(0, end), *ranges[::-1]]


def p2p_time(nbytes: float, tp: int, crosses_nodes: bool, topology: Topology) -> float:
    """One activation (or its gradient) sent to the next stage.  Across nodes each of the ``tp``
    ranks sends 1/tp of it over its own NIC and the receivers all-gather it inside the node
    (Megatron's scatter/gather, Narayanan et al. 2021 section 4.1); inside a node over NVLink."""
    if not crosses_nodes:
        return topology.intra_base_latency_s + nbytes / topology.intra_busbw
    if not topology.nics_per_node:
        raise ValueError(f"topology {topology.name} has no NICs (nics_per_node) to send between nodes")
    per_gpu = topology.nic_bandwidth * topology.nics_per_node / topology.gpus_per_node
    return topology.inter_base_latency_s + nbytes / tp / per_gpu + collective_time("all_gather", nbytes, tp, topology)


def dp_topology(topo: Topology, tp: int) -> Topology:
    """The fabric a data-parallel group sees: its members sit ``tp`` ranks apart."""
    per_node = max(1, topo.gpus_per_node // tp)
    nics = max(1, topo.nics_per_node * per_node // topo.gpus_per_node) if topo.nics_per_node else 0
    return dataclasses.replace(
        topo, gpus_per_node=per_node, nodes=max(1, topo.devices // tp // per_node), nics_per_node=nics
    )


def dp_sync_time(
    params: float, grads: float, dp: int, tp: int, data_parallel: str, gathers: int, topology: Topology
) -> tuple[float, float]:
    """(gradient reduction, parameter all-gathers) seconds per step for one device's stage.

    DDP all-reduces the gradients; FSDP reduce-scatters them and all-gathers the parameters
    ``gathers`` times (twice per micro-batch when they are freed after use, once when kept)."""
    if dp == 1:
        return 0.0, 0.0
    fabric = dp_topology(topology, tp)
    if data_parallel == "ddp":
        return collective_time("all_reduce", grads, dp, fabric), 0.0
    return (
        collective_time("reduce_scatter", grads, dp, fabric),
        gathers * collective_time("all_gather", params, dp, fabric),
    )


def exposed_dp_time(reduce: float, gather: float, last_backward: float, compute: float) -> float:
    """What data-parallel traffic adds to the step: gradients are reduced while the last micro-batch
    runs backward (bucketed, as DDP and FSDP do), parameter all-gathers are prefetched during compute."""
    return max(0.0, reduce - last_backward) + max(0.0, gather - compute)


def crosses_nodes(tp: int, dp: int, topology: Topology) -> bool:
    """Neighbouring stages sit tp * dp ranks apart (mesh dims pp, dp, tp outer to inner)."""
    return tp * dp >= topology.gpus_per_node and topology.nodes > 1


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def powers_of_two_dividing(n: int, at_most: int) -> list[int]:
    return [1 << k for k in range(int(math.log2(max(1, at_most))) + 1) if n % (1 << k) == 0]
