"""Where pipeline stages begin: between the blocks of the model's repeated block list, balanced by estimated time.

The blocks are found from the module tree (the longest ``nn.ModuleList`` of identical blocks, passes/fold.py),
never by name.  Each block's time is priced on autotp's captured graph with the cost model (roofline time of its
ops, forward and backward); what runs before the first block (the embedding) counts on the first stage, what runs
after the last (norm, head, loss) on the last.  The split itself is the mesh planner's ``balance_stages``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autotp.cost_models import load_topology
from autotp.cost_models.compute import op_time
from autotp.cost_models.pipeline import balance_stages
from autotp.passes.fold import Fold, blocks, find_fold
from autotp.passes.solve import Sizes


class StageError(ValueError):
    pass


@dataclass
class Costs:
    """Estimated seconds per block, and of what runs before the first block / after the last."""
    seconds: list
    first: float = 0.0  # the embedding side
    last: float = 0.0   # the head side

    def starts(self, stages: int) -> list:
        """The block where each of ``stages`` contiguous stages begins, balancing their time."""
        if not 1 <= stages <= len(self.seconds):
            raise StageError(f"{stages} pipeline stages need at least {stages} blocks; the model has "
                             f"{len(self.seconds)}")
        costs = list(self.seconds)
        costs[0] += self.first
        costs[-1] += self.last
        return [start for start, _ in balance_stages(costs, stages)]


def find_blocks(model: torch.nn.Module) -> Fold:
    """The model's repeated block list (at least two identical blocks), or a StageError saying what is needed."""
    found = find_fold(model, min_blocks=2)
    if found is None:
        raise StageError(f"{type(model).__name__} has no list of identical blocks (an nn.ModuleList of modules with "
                         "equal classes and shapes): pipeline stages are cut between such blocks")
    return found


def block_costs(gm: torch.fx.GraphModule, fold: Fold, topology=None, training: bool = True) -> Costs:
    """Price each block of ``gm`` (a graph captured whole, or folded: ``gm.meta["autotp_fold"]``, whose block 1
    stands for the middle blocks) and the parts before and after the blocks."""
    topo = load_topology(topology)
    folded = gm.meta.get("autotp_fold")
    where = (folded.blocks if folded else blocks(gm, fold)).where
    rep = fold.rep if folded else (lambda i: i)
    sizes = Sizes()
    passes = 3 if training else 1  # backward costs about twice the forward
    seconds: dict = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            place = where[node]
            seconds[place] = seconds.get(place, 0.0) + passes * op_time(sizes.flops(node), sizes.nbytes(node), topo)
    return Costs(seconds=[seconds.get(rep(i), 0.0) for i in range(fold.count)],
                 first=seconds.get("pre", 0.0), last=seconds.get("post", 0.0))
