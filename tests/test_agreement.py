"""Ranks must agree, and no rank hangs when another one fails or dies."""

from __future__ import annotations

import datetime
import functools
import os
import re
import time

import pytest
import torch
import torch.distributed as dist

import autotp
from autotp.runtime.rendezvous import RankDisagreement
from autotp.runtime.transport import CollectiveError
from autotp.tools.spawn import free_port, local_context
from examples import mlp
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL


def _different_models(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model, args = mlp.build(hidden=32, ffn=128 if rank == 0 else 64)
    with pytest.raises(RankDisagreement, match="ranks disagree on the model and input shapes"):
        autotp.parallelize(model, args)


def _different_input_shapes(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model, _ = mlp.build()
    with pytest.raises(RankDisagreement, match=r"ranks \[0\]: .*; ranks \[1\]: "):
        autotp.parallelize(model, (torch.randn(2, 8 + rank, 32),))


def test_ranks_with_different_models_or_inputs_are_told():
    run_ranks(2, _different_models)
    run_ranks(2, _different_input_shapes)


def _input_checks(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model, args = mlp.build()
    mine = (args[0] + rank,)  # same shape, different values on each rank
    disagree = (
        r"ranks disagree on the input values of call {} \(ranks \[0\]: \w+; ranks \[1\]: \w+\): "
        "every rank must pass"
    )
    first = autotp.parallelize(model, args)  # check_inputs="first"
    with pytest.raises(RankDisagreement, match=disagree.format(1)):
        first(*mine)
    first(*mine)  # only the first call is checked
    always = autotp.parallelize(model, args, check_inputs="always")
    torch.testing.assert_close(always(*args), model(*args), **TOL)
    with pytest.raises(RankDisagreement, match=disagree.format(2)):
        always(*mine)
    autotp.parallelize(model, args, check_inputs=False)(*mine)
    with pytest.raises(ValueError, match='check_inputs must be "first", "always" or False'):
        autotp.parallelize(model, args, check_inputs="sometimes")


def test_ranks_given_different_input_values_are_told():
    run_ranks(2, _input_checks)


def _spawn_pair(scenario, pg_timeout: float = 300, wait: float = 150) -> tuple[str, float]:
    """Run ``scenario(rank, queue)`` on 2 fresh gloo ranks; the first report (message, seconds) is returned
    and both processes are then ended (a stuck one would never leave)."""
    ctx = local_context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_start, args=(r, port, pg_timeout, scenario, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return queue.get(timeout=wait)
    finally:
        for p in procs:
            p.kill()
            p.join(timeout=30)


def _start(rank: int, port: int, pg_timeout: float, scenario, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=pg_timeout))
    scenario(rank, queue)
    time.sleep(600)  # ended by the parent


def _timed(queue, fn, *errors) -> None:
    """Report how long ``fn`` took to raise one of ``errors`` (or that it did not)."""
    start = time.monotonic()
    try:
        fn()
        queue.put(("no error", time.monotonic() - start))
    except errors as exc:
        queue.put((str(exc), time.monotonic() - start))


def _dies(stage: str, rank: int, queue) -> None:
    victim = 0 if stage == "planning" else 1
    if rank == victim:
        if stage == "before":
            os._exit(3)
        import autotp.api as api

        setattr(api, "solve_plan" if stage == "planning" else "rewrite", lambda *a, **k: os._exit(3))
    torch.manual_seed(0)
    model, args = mlp.build()
    _timed(queue, lambda: autotp.parallelize(model, args), RankDisagreement)  # the default timeout (120 s)


@pytest.mark.parametrize("stage", ["before", "planning", "loading"])
def test_a_dead_rank_is_named_within_seconds(stage):
    """A rank that dies before parallelize, while rank 0 plans, or while loading: its connection
    closes, and the survivor names it long before the 120 s deadline meant for slow ranks."""
    message, seconds = _spawn_pair(functools.partial(_dies, stage))
    lost = 0 if stage == "planning" else 1
    assert f"rank {lost} is gone" in message, message
    assert seconds < 30, seconds


def _slow_then_uneven(rank: int, world: int) -> None:
    """A rank 4 s late still gets in (the probes do not take it for dead); a second call that rank 1 never
    makes is named."""
    store = dist.distributed_c10d._get_default_store()
    torch.manual_seed(0)
    model, args = mlp.build()
    if rank == 1:
        time.sleep(4)
    sharded = autotp.parallelize(model, args)
    sharded(*args)  # the input check's exchange
    if rank == 1:
        store.wait(["test/done"])
        return
    call = f"autotp/{dist.group.WORLD.group_name}/1"
    exchanges = [f"{call}/{name}" for name in ("model", "plan", "loaded", "inputs/1")]
    written = [f"{x}/{r}" for x in exchanges for r in range(world)] + [
        f"{x}/read/{r}" for x in exchanges for r in range(world)
    ]
    assert not any(store.check([key]) for key in [*written, f"{call}/plan"]), "rank 0 deletes what was read"
    assert store.get(f"autotp/{dist.group.WORLD.group_name}/calls/1") == b"1"  # each rank's count stays
    with pytest.raises(
        RankDisagreement,
        match=r"rank 1 has made 1 parallelize call\(s\) on this group and this "
        r"rank 2: every rank must call autotp.parallelize equally often",
    ):
        autotp.parallelize(model, args, timeout=5)
    store.set("test/done", "1")


def test_slow_ranks_get_the_timeout_and_uneven_calls_are_named():
    run_ranks(2, _slow_then_uneven)


def _fails_in_third_step(how: str, rank: int, queue) -> None:
    torch.manual_seed(0)
    model, args = mlp.build()
    sharded = autotp.parallelize(model, args)
    for _ in range(2):
        sharded(*args).sum().backward()
    if rank == 1:
        if how == "exits":
            os._exit(3)
        time.sleep(600)  # stuck: alive, never joins the third step
    _timed(queue, lambda: sharded(*args).sum().backward(), CollectiveError)


@pytest.mark.parametrize("how", ["stuck", pytest.param("exits", marks=pytest.mark.serial)])  # exits: bound < 7 s
def test_a_rank_lost_mid_run_makes_the_others_name_the_collective(how):
    """Process-group timeout 8 s: a stuck rank's peer gives up at that timeout, an exited rank's at once
    (gloo sees the connection close); either way the error says which collective it waited in."""
    message, seconds = _spawn_pair(functools.partial(_fails_in_third_step, how), pg_timeout=8)
    assert re.search(
        r"(all_reduce|all_gather) of torch.float32 \[[\d, ]+\] for \w+ \(aten\.\w+\.\w+\) in down "
        r"\((forward|backward)\) did not complete",
        message,
    ), message
    if how == "stuck":
        assert re.search(r"timeout \(8 s\)|Timed out waiting 8000ms", message), message  # ours or gloo's
        assert 7 < seconds < 60, seconds
    else:
        assert re.search("Connection (closed|reset) by peer", message), message
        assert seconds < 7, seconds  # before the process group's timeout: the closed connection ended the wait
