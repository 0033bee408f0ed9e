"""Spawn N gloo ranks on this machine and run a test function on each (failures propagate)."""
from __future__ import annotations

import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    exit_quietly()


def exit_quietly() -> None:
    """Leave without interpreter teardown: gloo's threads sometimes abort the process at exit
    ("terminate called without an active exception") after all the work is done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world: int, fn, *args) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; an exception on any rank fails the caller."""
    mp.start_processes(_worker, args=(world, _free_port(), fn, args), nprocs=world, join=True, start_method="spawn")
