"""How many KV blocks the pool holds: as asked, or what the device has left once the step program has run.

``--gpu-memory-utilization`` is vLLM's: the share of each GPU's memory the server may use.  The pool gets what is
left of that share once everything else a step needs is counted, and that is measured by running it, not guessed:
the engine is built over a pool for one sequence, runs a profiling step (a prompt chunk of
``--max-num-batched-tokens`` tokens and a decode at the largest batch bucket) and captures every bucket's decode
graph when graphs are on; the peak torch allocated meanwhile holds the weights, the step's activations and the
graphs.  The pool is then ``utilization × total − (peak − the profiling pool) − memory outside torch`` (the CUDA
context, NCCL's buffers), the same number of blocks on every rank (the least any rank can hold), reallocated at that
size (``Engine.resize_pool``); the graphs, which point at the profiling pool, are captured again on their first
steps and take the room measured for them.

On the CPU there is no allocator peak to read: the pool is ``--kv-blocks``, ``--kv-cache-memory`` or room for
``--max-num-seqs`` sequences of ``--max-model-len`` (autotp/tools/serve.py), and the utilization is not read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class MemoryUse:
    """A device's memory as the profiling step left it, in bytes."""

    total: int  # the device's memory
    peak: int  # the most torch held: weights, the profiling step's activations, the graphs, the profiling pool
    profiling_pool: int  # the profiling pool's share of ``peak`` (given back before the pool is sized)
    outside: int = 0  # held outside torch's allocator: the CUDA context, NCCL's buffers


def kv_cache_bytes(use: MemoryUse, utilization: float) -> int:
    """Bytes left for the pool: ``utilization`` of the device less what a step needs besides its pool."""
    return int(utilization * use.total) - (use.peak - use.profiling_pool) - use.outside


def blocks_in(budget: int, per_block: int, what: str = "--kv-cache-memory") -> int:
    """Whole blocks in ``budget`` bytes; a budget that holds none is one line."""
    if budget < per_block:
        raise ValueError(f"{what} holds no block: {budget} bytes for the KV cache, {per_block} bytes a block a rank")
    return budget // per_block


def block_bytes(config, block_size: int, world: int, itemsize: int) -> int:
    """A rank's bytes a block: keys and values of every layer, its share of the KV heads (rounded up)."""
    from autotp.serving.generation import kv_heads_and_dim

    heads, dim = kv_heads_and_dim(config)
    return 2 * config.num_hidden_layers * block_size * -(-heads // world) * dim * itemsize


class CudaMemory:
    """The allocator's figures of one GPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def use(self, profiling_pool: int) -> MemoryUse:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        return MemoryUse(total, peak, profiling_pool, outside=max(0, total - free - reserved))


def profiled_blocks(engine, utilization: float, per_block: int, memory=None) -> int:
    """Blocks of the pool after ``engine``'s profiling step (every rank at once: a collective), measured by
    ``memory`` (``reset()``, then ``use(profiling_pool)``; the engine's GPU by default): the least any rank can
    hold."""
    memory = memory or CudaMemory(engine.device)
    memory.reset()
    engine.profile()
    use = memory.use(engine.pool_bytes())
    blocks = blocks_in(kv_cache_bytes(use, utilization), per_block, f"--gpu-memory-utilization {utilization}")
    least = torch.tensor([blocks], dtype=torch.long)
    dist.all_reduce(least, op=dist.ReduceOp.MIN, group=engine.control)
    return int(least)
