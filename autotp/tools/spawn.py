"""Run a function on N local gloo processes: the demo, examples and tests use it.  Real launches
(several machines, GPUs) are torchrun's job."""

from __future__ import annotations

import datetime
import importlib.util
import os
import socket
import sys
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Ranks start from a fork server that has imported these once: a fresh interpreter per rank spends
# seconds importing torch and transformers, which dominated short multi-process runs (the test suite);
# transformers.modeling_utils is what every transformers model imports first (0.5 s a rank on the 2-core VM);
# autotp.tools.warmup loads what a first capture loads lazily and fills its caches (tools/warmup.py).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.modeling_utils",
    "autotp",
    "autotp.tools.warmup",
]


def local_context():
    """The multiprocessing context local ranks start from (the preloaded fork server)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([m for m in _PRELOAD if importlib.util.find_spec(m) is not None])
    return ctx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local(world: int, fn, *args, timeout: float = 120, setup=None, backend: str = "gloo") -> list:
    """``[fn(rank, world, *args) for each rank]`` from ``world`` new processes in a ``backend`` group (picklable
    results); an exception on any rank is raised here.  ``setup()``, if given, runs once in a process the
    ranks are then forked from: what it leaves in memory (say, a capture every rank would repeat) they inherit."""
    port = free_port()
    queue = local_context().Queue()
    if setup is None:
        ranks = mp.start_processes(
            _worker,
            args=(world, port, fn, args, queue, timeout, backend),
            nprocs=world,
            join=False,
            start_method="forkserver",
        )
    else:
        ranks = mp.start_processes(
            _lead, args=(setup, world, port, fn, args, queue, timeout, backend), join=False, start_method="forkserver"
        )
    results = {}
    while not ranks.join(timeout=0.01):  # read while they run: a rank's put blocks once the pipe's buffer is full
        _drain(queue, results)
    while len(results) < world:  # all have left: the rest is in the pipe
        rank, result = queue.get(timeout=30)
        results[rank] = result
    return [results[rank] for rank in range(world)]


def _drain(queue, results: dict) -> None:
    try:
        while True:
            rank, result = queue.get_nowait()
            results[rank] = result
    except Empty:
        pass


def _lead(_, setup, world: int, port: int, fn, args, queue, timeout: float, backend: str) -> None:
    """Runs ``setup`` and forks the ranks from here; a rank's error is raised again here, and so in the caller."""
    torch.set_num_threads(1)
    setup()
    ranks = mp.start_processes(
        _worker, args=(world, port, fn, args, queue, timeout, backend), nprocs=world, join=False, start_method="fork"
    )
    while not ranks.join():
        pass


def _worker(rank: int, world: int, port: int, fn, args, queue, timeout: float, backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout))
    try:
        result = fn(rank, world, *args)
        try:  # rank 0 hosts the store: it leaves last, after every rank's final reads of it
            dist.barrier()
        except RuntimeError:  # gloo: connection closed
            pass  # another rank failed: its own error is the one reported
    finally:
        dist.destroy_process_group()
    queue.put((rank, result))
    queue.close()
    queue.join_thread()
    exit_quietly()


def exit_quietly() -> None:
    """Leave without interpreter teardown: gloo's threads sometimes abort the process at exit
    ("terminate called without an active exception") after all the work is done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
