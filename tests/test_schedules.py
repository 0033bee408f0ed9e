"""Pipeline schedules: PyTorch's names and classes, stage placement, micro-batch rules, and their pricing by
running each schedule's own action table (no process group)."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from autotp.cost_models.schedule_tables import (
    Table,
    action_table,
    in_flight,
    schedule_class,
    simulate,
    stage_ranks,
    step_units,
)
from autotp.parallel.schedules import ScheduleError, resolve


def test_names_as_pytorch_spells_them_any_case_and_classes():
    for name, cls in [
        ("GPipe", ScheduleGPipe),
        ("gpipe", ScheduleGPipe),
        ("1F1B", Schedule1F1B),
        ("1f1b", Schedule1F1B),
        ("Interleaved1F1B", ScheduleInterleaved1F1B),
        ("interleaved-1f1b", ScheduleInterleaved1F1B),
        ("LoopedBFS", ScheduleLoopedBFS),
        ("interleavedzerobubble", ScheduleInterleavedZeroBubble),
        ("ZBVZeroBubble", ScheduleZBVZeroBubble),
        ("DUALPIPEV", ScheduleDualPipeV),
    ]:
        assert resolve(name).cls is cls, name
    assert resolve(ScheduleInterleaved1F1B, 4).per_rank == 4
    assert resolve("1F1B").per_rank == 1 and resolve("Interleaved1F1B").per_rank == 2
    assert resolve("ZBVZeroBubble").per_rank == resolve("DualPipeV").per_rank == 2
    assert resolve("zbvzerobubble").name == "ZBVZeroBubble"

    class Mine(ScheduleInterleaved1F1B):
        pass

    assert resolve(Mine, 3).cls is Mine
    with pytest.raises(ScheduleError, match="unknown schedule 'pipedream': choose one of GPipe, 1F1B"):
        resolve("pipedream")
    for base in ("PipelineScheduleSingle", PipelineScheduleMulti, PipelineScheduleSingle):
        with pytest.raises(ScheduleError, match="base class without an order"):
            resolve(base)
    with pytest.raises(ScheduleError, match="give a name"):
        resolve(42)
    with pytest.raises(ScheduleError, match="holds exactly 2 stage"):
        resolve("ZBVZeroBubble", 4)
    with pytest.raises(ScheduleError, match="holds exactly 1 stage"):
        resolve("1F1B", 2)


def test_stages_are_placed_as_the_schedule_places_them():
    assert resolve("ZBVZeroBubble").stage_indices(2, 0) == [0, 3]  # a V: the first rank also holds the last stage
    assert resolve("DualPipeV").stage_indices(4, 1) == [1, 6]
    assert resolve("Interleaved1F1B", 4).stage_indices(2, 1) == [1, 3, 5, 7]  # a loop
    assert resolve("1F1B").stage_indices(4, 2) == [2]
    assert stage_ranks("ZBVZeroBubble", 4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert stage_ranks("InterleavedZeroBubble", 2, 3) == (0, 1, 0, 1, 0, 1)


def test_microbatch_counts_a_schedule_cannot_run_are_refused_before_anything_is_built():
    with pytest.raises(
        ScheduleError,
        match=r"1F1B schedule cannot run 1 micro-batches over 2 pipeline ranks.*"
        r"greater than or equal to the number of stages",
    ):
        resolve("1F1B").check(2, 1)
    with pytest.raises(ScheduleError, match=r"DualPipeV schedule cannot run 3 .* at least as many microbatches"):
        resolve("DualPipeV").check(2, 3)
    with pytest.raises(ScheduleError, match="multiple of the number of rounds"):
        resolve("Interleaved1F1B").check(2, 5)
    with pytest.raises(ScheduleError, match="give a positive number"):
        resolve("GPipe").check(2, 0)
    for name in ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        resolve(name).check(2, 4)  # what the training tests run


def test_a_table_runs_on_a_clock():
    """GPipe over 2 ranks, 2 micro-batches, stages of unequal speed, half a second per send (by hand)."""
    table = Table(
        {
            0: ((0, "F", 0), (0, "F", 1), (0, "B", 0), (0, "B", 1)),
            1: ((1, "F", 0), (1, "F", 1), (1, "B", 0), (1, "B", 1)),
        },
        (0, 1),
    )
    run = simulate(table, forward=[1, 2], backward_input=[1, 1], backward_weight=[1, 3], send=0.5)
    # rank 1: F0 1.5-3.5, F1 3.5-5.5, B0 5.5-9.5, B1 9.5-13.5; rank 0: B0 10-12, B1 14-16
    assert run.seconds == 16 and run.busy == [6, 12] and run.held == [2, 2]
    zero_bubble = Table({0: ((0, "F", 0), (0, "I", 0), (0, "W", 0))}, (0,))
    assert simulate(zero_bubble, [1], [1], [1], held=[3.0]).held == [3.0]  # kept until the weight gradient
    broken = Table({0: ((0, "B", 0), (0, "F", 0))}, (0,))
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(broken, [1], [1], [1])


def test_bubbles_and_memory_match_the_literature():
    # Narayanan et al. 2021: GPipe and 1F1B take m + p - 1 stage-times, interleaving divides the bubble by v;
    # 1F1B keeps min(p - i, m) micro-batches on stage i, GPipe all m
    for p, m in [(2, 4), (4, 8), (8, 96)]:
        assert step_units("GPipe", p, m, 1) == step_units("1F1B", p, m, 1) == m + p - 1
        assert [in_flight("1F1B", p, m, i, 1) for i in range(p)] == [min(p - i, m) for i in range(p)]
        assert in_flight("GPipe", p, m, 0, 1) == m
        for v in (2, 4):
            assert step_units("Interleaved1F1B", p, m, v) == pytest.approx(m + (p - 1) / v)
            # Korthikanti et al. 2022 section 4.2.3: the first stage holds p (1 + (p - 1) / (p v)) micro-batches
            assert in_flight("Interleaved1F1B", p, m, 0, v) == pytest.approx(p * (1 + (p - 1) / (p * v)))
            # Qi et al. 2024: ZB-H1 leaves (p - 1)(F + B - 2W) of 1F1B's (p - 1)(F + B): a third with F = I = W
            assert step_units("InterleavedZeroBubble", p, m, v) == pytest.approx(m + (p - 1) / (3 * v))
        for name in ("ZBVZeroBubble", "DualPipeV"):
            assert step_units(name, p, m, 2) < step_units("Interleaved1F1B", p, m, 2)
            assert max(in_flight(name, p, m, i, 2) for i in range(p)) <= p + 1  # 1F1B's memory (DualPipe: p + 1)
    with pytest.raises(ValueError, match="number of stages"):
        step_units("1F1B", 8, 4, 1)


def test_long_steps_are_extended_by_their_steady_state():
    """Tables beyond 16 micro-batches (and two rounds of every stage) are run at fewer: the extension equals
    running the whole table."""
    for name, v in [("Interleaved1F1B", 2), ("ZBVZeroBubble", 2), ("GPipe", 1), ("1F1B", 1)]:
        table = action_table(schedule_class(name), 4, v, 96)
        ones = [1.0] * (4 * v)
        run = simulate(table, ones, ones, ones)
        assert step_units(name, 4, 96, v) == pytest.approx(run.seconds / (3 * v)), name
        assert [in_flight(name, 4, 96, r, v) for r in range(4)] == pytest.approx([h / v for h in run.held]), name
