"""Pipeline schedules as torch.distributed.pipelining names them, and which stages each pipeline rank holds.

``schedule=`` is one of PyTorch's names, case-insensitive as ``get_schedule_class`` takes them ("GPipe",
"1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"; autotp's older
"interleaved-1f1b" too), or a schedule class.  Single-stage schedules hold one stage per rank; the others hold
``virtual_stages`` (default 2), placed as the schedule places them: in a loop (stage s on rank s mod pp), or in a
V for ZBVZeroBubble and DualPipeV (exactly 2 per rank: rank r holds stages r and 2 pp - 1 - r).  The micro-batch
count is checked by the schedule's own constructor before any stage is built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
)

from autotp.cost_models.schedule_tables import action_table, schedule_class
from autotp.runtime.transport import CollectiveError

V_SHAPED = (ScheduleZBVZeroBubble, ScheduleDualPipeV)  # two stages per rank, the first rank's first and last
NAMES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# how c10d reports a send or receive whose peer is gone or late (gloo, NCCL)
_COMMUNICATION = re.compile(r"Timed out|timeout|Connection (closed|reset)|peer|recv|send|NCCL|gloo", re.IGNORECASE)
DEFAULT_VIRTUAL = 2  # stages per rank of a multi-stage schedule unless told (interleaved 1F1B's smallest)


class ScheduleError(ValueError):
    pass


@dataclass(frozen=True)
class Schedule:
    cls: type  # the torch.distributed.pipelining class that runs it
    per_rank: int  # stages each pipeline rank holds

    @property
    def name(self) -> str:
        return self.cls.__name__.removeprefix("Schedule")

    @property
    def single(self) -> bool:
        return issubclass(self.cls, PipelineScheduleSingle)

    def stages(self, pp: int) -> int:
        return pp * self.per_rank

    def check(self, pp: int, microbatches: int) -> None:
        """Raise a ScheduleError saying what to change when the schedule cannot run ``microbatches`` on ``pp``
        ranks (its constructor's own rules: 1F1B and DualPipeV need at least as many micro-batches as stages,
        the interleaved ones a multiple of their rounds)."""
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ScheduleError(f"microbatches={microbatches!r}: give a positive number of micro-batches")
        try:
            action_table(self.cls, pp, self.per_rank, microbatches)
        except ValueError as exc:
            raise ScheduleError(
                f"the {self.name} schedule cannot run {microbatches} micro-batches over {pp} "
                f"pipeline ranks x {self.per_rank} stages: {exc} Change microbatches (and the "
                "batch with it), virtual_stages or the schedule"
            ) from None

    def placement(self, pp: int) -> tuple:
        """The pipeline rank of each stage, as the schedule places them."""
        return action_table(self.cls, pp, self.per_rank, 2 * self.stages(pp)).rank_of

    def stage_indices(self, pp: int, rank: int) -> list[int]:
        """The stages pipeline rank ``rank`` holds (ascending)."""
        return [s for s, r in enumerate(self.placement(pp)) if r == rank]

    def build(self, stages: list, microbatches: int, loss_fn):
        """The runtime schedule over this rank's ``PipelineStage`` objects (ascending stage index)."""
        return self.cls(stages[0] if self.single else stages, microbatches, loss_fn=loss_fn, scale_grads=True)


def resolve(schedule, virtual_stages: int | None = None) -> Schedule:
    """``schedule`` (a name or a class) with its stages per rank; a ScheduleError for anything else."""
    if isinstance(schedule, str):
        try:
            cls = schedule_class(schedule)
        except ValueError:
            raise ScheduleError(
                f"unknown schedule {schedule!r}: choose one of {', '.join(NAMES)} "
                "(case-insensitive), or pass a schedule class"
            ) from None
    elif isinstance(schedule, type) and issubclass(schedule, (PipelineScheduleSingle, PipelineScheduleMulti)):
        cls = schedule
    else:
        raise ScheduleError(
            f"schedule={schedule!r}: give a name ({', '.join(NAMES)}) or a class from torch.distributed.pipelining"
        )
    if cls in (PipelineScheduleSingle, PipelineScheduleMulti):
        raise ScheduleError(
            f"{cls.__name__} is a base class without an order of its own: choose one of {', '.join(NAMES)}"
        )
    if issubclass(cls, PipelineScheduleSingle):
        fixed = 1
    elif issubclass(cls, V_SHAPED):
        fixed = 2
    else:
        fixed = None
    if virtual_stages is not None and (not isinstance(virtual_stages, int) or virtual_stages < 1):
        raise ScheduleError(f"virtual_stages={virtual_stages!r}: give the number of stages each pipeline rank holds")
    if fixed is not None and virtual_stages not in (None, fixed):
        raise ScheduleError(
            f"the {cls.__name__.removeprefix('Schedule')} schedule holds exactly {fixed} stage(s) "
            f"per pipeline rank, not virtual_stages={virtual_stages}: drop virtual_stages or choose "
            "Interleaved1F1B, LoopedBFS or InterleavedZeroBubble"
        )
    return Schedule(cls, fixed or virtual_stages or DEFAULT_VIRTUAL)


def check_evaluates(runner) -> None:
    """Forward-only runs of a V-shaped schedule fail in torch 2.13 (``eval`` still hands an input gradient between
    the two stages a rank holds: "can't steal_bwd_input if this stage doesn't have backward"): say so first."""
    if isinstance(runner, V_SHAPED):
        raise NotImplementedError(
            f"evaluate() with {type(runner).__name__}: PyTorch's forward-only run of V-shaped "
            "schedules fails (its eval still runs their backward hand-over); evaluate with a "
            "pipeline on another schedule, or on autotp.full_state_dict(pipeline) in one process"
        )


def step_failure(exc: Exception, mine: list, placement: tuple, group) -> Exception:
    """What a pipeline step that raised ``exc`` reports: a collective's error (TP, FSDP) with this rank's stages
    added; a failed send or receive (c10d's errors: a peer died, is stuck, or timed out) as a CollectiveError
    naming the "pp" dimension, the stages and the peers; anything else as it is."""
    where = f"pipeline stage(s) {mine}"
    chain = [exc]  # pipelining re-raises a stage's error as "[Stage 1] failed to run forward" from it
    while chain[-1].__cause__ is not None and len(chain) < 16:
        chain.append(chain[-1].__cause__)
    named = next((e for e in chain if isinstance(e, CollectiveError)), None)
    if named is not None:
        return CollectiveError(f"{where}: {named}")
    if not isinstance(exc, (dist.DistError, RuntimeError)) or not any(_COMMUNICATION.search(str(e)) for e in chain):
        return exc
    ranks = dist.get_process_group_ranks(group)
    peers = sorted({s for k in mine for s in (k - 1, k + 1) if 0 <= s < len(placement) and s not in mine})
    with_whom = ", ".join(f"stage {s} on rank {ranks[placement[s]]}" for s in peers)
    return CollectiveError(
        f"autotp: a send or receive of {where} over mesh dimension 'pp' (ranks {ranks}) with "
        f"{with_whom} did not complete: a peer died, is stuck, or runs other code (look at its "
        f"output); parallelize's timeout= bounds the wait. Cause: {chain[-1]}"
    )
