"""What expert parallelism changes in a tensor x pipeline x data layout: pure functions.

A block's routed experts are read from a TP plan that splits every expert over the tp ranks (Megatron's
expert tensor parallelism).  An expert-parallel degree ``ep`` deals them out instead (torchtitan, Megatron's
"MoE parallel folding"): with ``etp == tp`` each expert keeps its TP split and the EP group takes ep data-parallel
replicas (the ranks of one TP position, tp apart); with ``etp == 1`` experts are whole and the group takes ep
consecutive ranks, each TP rank dispatching 1/tp of its tokens.  Every rank computes as many expert FLOPs as under
expert TP (routing taken as uniform, the busiest rank ``imbalance`` times the average), in fewer, fuller groups of
rows; tokens go and come back by all-to-all (dispatch and combine, forward and backward) on the links the group
spans; a rank holds E/ep experts, 1/etp of each, their data-parallel copies on dp x tp / (ep x etp) ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autotp.cost_models import schedule_tables as pipe
from autotp.cost_models.communication import collective_time
from autotp.cost_models.compute import product_time
from autotp.cost_models.topology import Topology


@dataclass
class Experts:
    """A block's routed experts under the TP plan (expert TP over its tp ranks), per sample."""

    count: int  # experts
    products: list  # ragged grouped products: (rows an expert, n, k on a TP rank, n, k whole)
    seconds: float  # what the TP plan's seconds count for those products (forward + backward)
    routed_bytes: float  # one dispatch of the routed rows (the combine brings as many back)
    state: dict = field(default_factory=dict)  # expert parameters' bytes by kind on a TP rank
    whole: dict = field(default_factory=dict)  # and unsplit (params, grads, optimizer)


def options(experts: Experts | None, tp: int, dp: int) -> list[tuple[int, int]]:
    """(ep, etp) layouts of the experts over a tp x dp grid: none (1, tp); the EP group taken from the data-
    parallel replicas (etp = tp, ep dividing dp); or from dp x tp ranks with whole experts (etp = 1, tp dividing
    ep).  ep divides the number of experts."""
    found = [(1, tp)]
    if experts is None:
        return found
    for ep in pipe.divisors(experts.count)[1:]:
        if dp % ep == 0:
            found.append((ep, tp))
        if tp > 1 and ep % tp == 0 and (dp * tp) % ep == 0:
            found.append((ep, 1))
    return found


def expert_dp(dp: int, tp: int, ep: int, etp: int) -> int:
    """Ranks holding the same experts (they sum their gradients and share their optimizer state)."""
    return dp * tp // (ep * etp)


def product_seconds(experts: Experts, tp: int, ep: int, etp: int, imbalance: float, topology: Topology) -> float:
    """The expert products of one sample per replica on the busiest rank, forward and backward: E/ep groups of
    the rows ep replicas (etp = tp) or ep/tp of them (etp = 1) route to each expert."""
    if ep == 1:
        return experts.seconds
    groups, total = experts.count / ep, 0.0
    for rows, n_tp, k_tp, n, k in experts.products:
        m = rows * ep * imbalance / (tp if etp == 1 else 1)
        total += product_time(m, *((n, k) if etp == 1 else (n_tp, k_tp)), topology, groups, ragged=True)
    return 3 * total


def all_to_all_seconds(
    experts: Experts, samples: int, tp: int, ep: int, etp: int, imbalance: float, topology: Topology
) -> float:
    """Dispatch and combine, forward and backward, of one micro-batch of ``samples`` per replica."""
    if ep == 1:
        return 0.0
    sent = samples * experts.routed_bytes * imbalance / (tp if etp == 1 else 1)
    fabric = pipe.dp_topology(topology, tp) if etp == tp else topology  # members tp apart, or neighbours
    return 4 * collective_time("all_to_all", sent, ep, fabric)


def buffer_bytes(experts: Experts, samples: int, tp: int, ep: int, etp: int, imbalance: float) -> float:
    """What one layer's dispatch holds at once: the rows a rank sends and the rows it receives."""
    if ep == 1:
        return 0.0
    return 2 * samples * experts.routed_bytes * imbalance / (tp if etp == 1 else 1)
