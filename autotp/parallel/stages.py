"""Where pipeline stages begin: between the blocks of the model's repeated block list, balanced by estimated time.

The blocks are found from the module tree (the longest ``nn.ModuleList`` of identical blocks, passes/fold.py),
never by name.  Each block's cost is priced on autotp's captured graph with the cost model (roofline time of
its ops, forward and backward; its parameters' training state and its ops' outputs, a bound on the activations
it keeps); what runs before
the first block (the embedding) goes to the first stage, what runs after the last (norm, head, loss) to the last.
``balance`` is a pure function of those numbers, so a mesh planner can call it with its own estimates.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autotp.cost_models import load_topology
from autotp.cost_models.compute import op_time
from autotp.cost_models.memory import state_factor
from autotp.passes.fold import Fold, blocks, find_fold
from autotp.passes.solve import Sizes


class StageError(ValueError):
    pass


@dataclass
class Costs:
    """Estimated seconds and bytes per block, and of what runs before the first block / after the last."""
    seconds: list
    memory: list
    first: tuple = (0.0, 0.0)  # (seconds, bytes) of the embedding side
    last: tuple = (0.0, 0.0)   # (seconds, bytes) of the head side


def find_blocks(model: torch.nn.Module) -> Fold:
    """The model's repeated block list (at least two identical blocks), or a StageError saying what is needed."""
    found = find_fold(model, min_blocks=2)
    if found is None:
        raise StageError(f"{type(model).__name__} has no list of identical blocks (an nn.ModuleList of modules with "
                         "equal classes and shapes): pipeline stages are cut between such blocks")
    return found


def balance(seconds: list, stages: int, *, first: float = 0.0, last: float = 0.0, memory: list | None = None,
            first_memory: float = 0.0, last_memory: float = 0.0, memory_limit: float | None = None) -> list:
    """The block indices where each of ``stages`` contiguous stages begins (the first is 0), minimizing the
    slowest stage's time (the pipeline's step is paced by it) among splits whose stages fit ``memory_limit``.
    ``first`` / ``last``: extra time of the first and last stage (embedding; head and loss)."""
    n = len(seconds)
    if not 1 <= stages <= n:
        raise StageError(f"{stages} pipeline stages need at least {stages} blocks; the model has {n}")
    memory = memory if memory is not None else [0.0] * n
    t_prefix, m_prefix = [0.0], [0.0]
    for t, m in zip(seconds, memory, strict=True):
        t_prefix.append(t_prefix[-1] + t)
        m_prefix.append(m_prefix[-1] + m)

    def stage_cost(j: int, a: int, b: int) -> float | None:
        """Time of stage j (0-based) over blocks [a, b), or None when it does not fit."""
        extra_t = (first if j == 0 else 0.0) + (last if j == stages - 1 else 0.0)
        extra_m = (first_memory if j == 0 else 0.0) + (last_memory if j == stages - 1 else 0.0)
        if memory_limit is not None and m_prefix[b] - m_prefix[a] + extra_m > memory_limit:
            return None
        return t_prefix[b] - t_prefix[a] + extra_t

    inf = float("inf")
    # best[j][b]: (slowest stage, start of stage j) over splits of blocks [0, b) into stages 0..j
    best = [[(inf, -1)] * (n + 1) for _ in range(stages)]
    for b in range(1, n + 1):
        cost = stage_cost(0, 0, b)
        if cost is not None:
            best[0][b] = (cost, 0)
    for j in range(1, stages):
        for b in range(j + 1, n + 1):
            for a in range(j, b):
                cost = stage_cost(j, a, b)
                if cost is not None and best[j - 1][a][0] < inf:
                    best[j][b] = min(best[j][b], (max(best[j - 1][a][0], cost), a))
    if best[stages - 1][n][0] == inf:
        need = (m_prefix[n] + first_memory + last_memory) / stages
        raise StageError(f"no split of {n} blocks into {stages} stages fits {memory_limit / 2**30:.2f} GiB per device "
                         f"(at least {need / 2**30:.2f} GiB on average): use more stages or tensor parallelism")
    starts, b = [], n
    for j in range(stages - 1, -1, -1):
        a = best[j][b][1]
        starts.append(a)
        b = a
    return starts[::-1]


def block_costs(gm: torch.fx.GraphModule, fold: Fold, topology=None, training: bool = True) -> Costs:
    """Price each block of ``gm`` (a graph captured whole, or folded: ``gm.meta["autotp_fold"]``, whose block 1
    stands for the middle blocks) and the parts before and after the blocks."""
    topo = load_topology(topology)
    folded = gm.meta.get("autotp_fold")
    where = (folded.blocks if folded else blocks(gm, fold)).where
    rep = fold.rep if folded else (lambda i: i)
    sizes = Sizes()
    seconds: dict = {}
    memory: dict = {}
    passes = 3 if training else 1  # backward costs about twice the forward
    params = dict(gm.named_parameters(remove_duplicate=False))
    for node in gm.graph.nodes:
        place = where.get(node)
        if node.op == "get_attr":
            place = next((where[u] for u in node.users if isinstance(where.get(u), (int, str))), "pre")
            tensor = params.get(node.target)
            if tensor is not None:
                factor = state_factor(tensor.element_size(), training) if tensor.requires_grad else 1.0
                held = sizes.nbytes(node) * factor
                memory[place] = memory.get(place, 0.0) + held
        elif node.op == "call_function":
            seconds[place] = seconds.get(place, 0.0) + passes * op_time(sizes.flops(node), sizes.nbytes(node), topo)
            if training:
                memory[place] = memory.get(place, 0.0) + sizes.nbytes(node)
    return Costs(seconds=[seconds.get(rep(i), 0.0) for i in range(fold.count)],
                 memory=[memory.get(rep(i), 0.0) for i in range(fold.count)],
                 first=(seconds.get("pre", 0.0), memory.get("pre", 0.0)),
                 last=(seconds.get("post", 0.0), memory.get("post", 0.0)))
