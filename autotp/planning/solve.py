"""Choose one strategy per node with an ILP (PuLP + bundled CBC), written as math.

Sets: nodes v with candidate strategies S_v (planning/candidates.py); for a strategy s its output placement
out(s) and the placement in(s, u) it reads input u in; cores c (attention cores that may be recomputed); kept
tensors k (what the backward holds, passes/kept_tensors.py).

Variables:
    x[v,s] in {0,1}       v computes with strategy s                      (one per candidate)
    r[c]   in {0,1}       core c is recomputed in the backward            (recompute="priced"; 1 when "forced")
    a[k]   in [0,1]       some chosen strategy keeps tensor k
    piece[k] in {0,1}     tensor k, kept gathered from tokens, is kept as this rank's piece and gathered again
    z[e,p,q] >= 0         edge e carries its producer's p to a consumer that reads q (transport form)
    n[t,p,q] >= 0         tensor t is converted from p to q once, however many readers share it
    g[t]   >= 0           the backward sums partial gradients of t (a replicated input of a sharded op)

Objective, per step, in seconds (the named terms below):
    min  sum x[v,s] w_v op_time(v,s)                       compute: the op's share of the work
       + sum r[c] forward_time(c)                          recomputed cores' forward, paid again
       + sum piece[k] regather_time(k)                     tokens kept as this rank's piece, all-gathered again
       + sum pair[b] w latency                             a bias summed with its weight: one all-reduce
       + sum n[t,p,q] w_t conversion_time(t,p,q)           resharding collectives
       + together latency + sum g[t] w_t (allreduce(t) - latency or allreduce(t))   gradient sums
       - sum h[t] w_t (allreduce(t) - reduce_scatter(t))   a gathered shard's gradient reduce-scattered instead
       - sum o[t,p,q] w_t                                  async_tp: what fusing conversion n[t,p,q] with its
                                                           products saves (planning/overlap.py, fused_time)
       + 1e-10 sum x[v,s] index(s)                         tie break: the rules' earlier options

Constraints (the families, in the order they are added):
    choose_one:     sum_s x[v,s] = 1                              for every v
    recompute:      rx[c,v,s] >= x[v,s] + r[c] - 1;  r tied alike across folded blocks
    activations:    x[v,s] <= a[k] <= sum of the x that keep k;  a token piece or a freed core discounts a[k]:
                    whole[k] >= a[k] - piece[k], piece[k] <= sum x[k, split by tokens] (held whole[k] + piece[k]/t)
    token_split:    x[v,s] = 0 for s whole or partial where it could split tokens   (sequence_parallel=True)
    ties:           x[a,s] = x[b,s] for tied nodes of folded blocks
    bias_pairs:     pair[b] >= x[v,s] for a grouped shard of the bias or its weight
    edges:          sum_q z[e,p,q] = sum_{s: out(s)=p} x[src,s];  sum_p z[e,p,q] = sum_{s: in(s)=q} x[dst,s];
                    n[t,p,q] >= z[e,p,q];  g[t] >= sum of the x that read t partially in the backward
    gradient_sums:  together >= g[t] (coalesced);  h[t] <= g[t], h[t] <= sum x[t, sharded]
    overlap:        f = z[e,p,q] AND x[v,s] (or n AND x) for each fusable pair;  o <= sum f saving(v,s),
                    o <= n cap                                                        (async_tp=True)
    memory:         sum of memory terms <= limit  (added only when the fastest plan does not fit)

Memory enters mostly through the candidates: large parameters are only offered sharded, so no global
constraint couples the blocks and CBC stays fast; the capacity constraint is added only when needed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.fx import Node

from autotp.cost_models.memory import memory_limit as device_limit
from autotp.cost_models.pricing import Sizes
from autotp.cost_models.topology import Topology
from autotp.options import PlanOptions
from autotp.passes.recompute import attention_cores
from autotp.planning.candidates import Candidates
from autotp.planning.ilp import Ilp
from autotp.planning.overlap import price_overlap
from autotp.planning.solution import Imposed, Solution


def solve(
    gm: torch.fx.GraphModule,
    found: Candidates,
    topology: Topology,
    options: PlanOptions,
    *,
    sizes: Sizes | None = None,
    weights: Mapping[Node, int] | None = None,
    ties: Sequence[tuple[Node, Node]] = (),
    recompute: str = "off",
    imposed: Imposed | None = None,
) -> Solution:
    """The fastest plan whose estimated memory per device fits ``options.memory_limit`` (cost_models.memory).

    ``weights``: node -> how many real nodes it stands for (folded blocks); a conversion or gradient sum is
    counted as often as its tensor.  ``ties``: node pairs that must choose alike.  ``options.sequence_parallel``:
    every op that may split the tokens keeps its output split (by tokens, or as tensor parallelism splits it),
    never whole or partial.  ``recompute``: "off", "forced" (every attention core is recomputed) or "priced"
    (each core's forward time against the bytes it frees, taken where memory demands it).  ``imposed``: how a
    hand-written plan runs (tools/hand_plans.py).
    """
    ilp = Ilp(gm, found, topology, options, sizes or Sizes(), weights or {}, imposed or Imposed())
    ilp.choose_one()
    cores = attention_cores(gm, ilp.grad) if recompute != "off" else []
    again = ilp.recompute(cores, recompute == "forced", ties)
    gathers = ilp.activations(cores, again)
    if options.sequence_parallel and found.world > 1:  # one rank splits nothing
        ilp.token_split()
    ilp.tie(ties)
    ilp.bias_pairs()
    ilp.gradient_sums(ilp.edges())
    if options.async_tp and found.world > 1:
        price_overlap(ilp)
    limit = device_limit(topology, options.memory_limit)
    ilp.minimise(limit)
    return ilp.solution(cores, again, gathers)
