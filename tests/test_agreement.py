"""Ranks must agree, and no rank hangs when another one fails or dies."""
from __future__ import annotations

import datetime
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import autotp
from autotp.agree import RankDisagreement
from distributed import run_ranks
from examples import mlp


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


def _survivor(rank: int, port: int, stage: str, queue) -> None:
    """Rank ``1 - victim`` reports how long it took to raise; the victim dies at ``stage``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300))
    victim = 0 if stage == "planning" else 1
    if rank == victim:
        if stage == "before":
            os._exit(3)
        import autotp.api as api
        target = "_solve" if stage == "planning" else "rewrite"
        setattr(api, target, lambda *a, **k: os._exit(3))
    torch.manual_seed(0)
    model, args = mlp.build()
    start = time.monotonic()
    try:
        autotp.parallelize(model, args, timeout=5)
        queue.put(("no error", time.monotonic() - start))
    except RankDisagreement as exc:
        queue.put((str(exc), time.monotonic() - start))
    queue.close()
    queue.join_thread()
    os._exit(0)


@pytest.mark.parametrize("stage", ["before", "planning", "loading"])
def test_a_dead_rank_makes_the_others_raise_in_time(stage):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_survivor, args=(r, port, stage, queue)) for r in range(2)]
    for p in procs:
        p.start()
    message, seconds = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
    assert "did not" in message and "within 5 s" in message and "failed or died" in message, message
    assert seconds < 60, seconds
