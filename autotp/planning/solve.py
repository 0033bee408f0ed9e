"""Choose one strategy per node with an ILP (PuLP + bundled CBC).

The objective is estimated time per training step: compute (divided by N when sharded) +
resharding collectives (each (tensor, target placement) paid once, however many users share it) +
the backward all-reduce that a replicated input of a sharded op needs (Megatron's ``f``; replicated
parameters' in one all-reduce, one latency) + the backward all-gather of tokens kept as this rank's piece.
Memory enters through the parameter options (strategies.py): large parameters are only offered
sharded, so no global constraint couples the blocks and CBC stays fast; the per-device capacity
constraint is added only when the fastest plan does not fit.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import pulp
import torch

from autotp.cost_models import collective_time
from autotp.cost_models.memory import breakdown, smallest_fitting_world
from autotp.cost_models.pricing import (
    Sizes,
    activation_bytes,
    conversion_seconds,
    kept_bytes,
    op_memory,
    op_seconds,
    regather_time,
)
from autotp.cost_models.topology import Topology
from autotp.ops.strategies import Context, input_slots, is_placed, needs_grad, on_tokens
from autotp.ops.table import stored_views
from autotp.passes.gradients import bias_weights, coalesced, partial_grad
from autotp.passes.recompute import attention_cores, dropped, price_recompute
from autotp.placement import Partial, R, Replicate, Shard

# Equal-cost plans are common (an all-gather before a matmul or a reduce-scatter after it move the
# same bytes); a tenth of a nanosecond per option index makes the solver prefer the rules' earlier
# options, so the same graph always gets the same plan, folded or whole.
TIE_BREAK = 1e-10


class PlanningError(RuntimeError):
    pass


class DoesNotFit(PlanningError):
    """No plan among the options fits the memory limit."""


@dataclass
class Solution:
    choice: dict          # node -> Strategy
    seconds: float        # estimated step time of the chosen plan
    compute: float        # the ops' own part of it (recomputation and grouped weights' gradient sums included)
    memory: dict          # estimated bytes per device by kind (cost_models.memory.breakdown)
    recomputed: list = field(default_factory=list)  # attention cores whose backward computes them again
    regathers: dict = field(default_factory=dict)   # tensor kept as token pieces -> its backward re-gather's
    #                                                 {"bytes", "count" (folded), "seconds" (all counts)}


def solve(gm: torch.fx.GraphModule, ctx: Context, topology: Topology, *, training: bool = True,
          memory_limit: float | None = None, sizes: Sizes | None = None, gather_outputs: bool = True,
          weights: dict | None = None, ties: list = (), sequence_parallel: bool = False,
          recompute: str = "off") -> Solution:
    """The fastest plan whose estimated memory per device fits ``memory_limit`` (default 90% of the
    device's memory: CUDA context and fragmentation take the rest).

    ``weights``: node -> how many real nodes it stands for (folded blocks); a conversion or gradient
    sum is counted as often as its tensor.  ``ties``: node pairs that must choose alike.
    ``sequence_parallel``: every op that may split the tokens (ctx.token_options) keeps its output split
    (by tokens, or as tensor parallelism splits it), never whole or partial.  ``recompute``: "off",
    "forced" (every attention core is recomputed) or "priced" (each core's forward time against the bytes
    it frees, taken where memory demands it).
    """
    t = ctx.world
    w = (weights or {}).get
    sizes = sizes or Sizes()
    problem = pulp.LpProblem("autotp", pulp.LpMinimize)
    trainable = dict(gm.named_parameters(remove_duplicate=False))
    grad = needs_grad(gm) if training else set()
    costs, compute, memory, kinds, preference = [], [], [], {}, []
    pairs = {b: a for b, a in bias_weights(gm).items() if training and {a, b} <= ctx.strategies.keys()
             and {a.target, b.target} <= trainable.keys()}
    paired = set(pairs) | set(pairs.values())
    x = {}
    saves: dict = {}       # kept tensor key -> (bytes, options that keep it)
    for i, (node, options) in enumerate(ctx.strategies.items()):
        x[node] = [problem.add_variable(f"x{i}_{k}", cat="Binary") for k in range(len(options))]
        problem += pulp.lpSum(x[node]) == 1
        weight = w(node, 1)
        for k, (var, s) in enumerate(zip(x[node], options, strict=True)):
            compute.append(var * weight * op_seconds(node, s, sizes, t, topology, training, node in paired))
            preference.append(var * weight * k * TIE_BREAK)
            for kind, held in op_memory(node, s, sizes, t, trainable, training).items():
                if held:
                    term = var * weight * held
                    memory.append(term)
                    kinds.setdefault(kind, []).append(term)
            for key, held in kept_bytes(node, s, sizes, t, grad):
                saves.setdefault(key, (held, [], set()))[1].append(var)
                saves[key][2].add(node)
    cores = attention_cores(gm, grad) if recompute != "off" else []
    again, recompute_costs = price_recompute(
        problem, cores, ctx, x, recompute == "forced", ties,
        lambda node, s: w(node, 1) * op_seconds(node, s, sizes, t, topology, training) / 3)
    compute += recompute_costs
    costs += compute
    frees = {key: r for core, r in zip(cores, again, strict=True)
             for key in dropped({key: nodes for key, (_, _, nodes) in saves.items()}, core)}
    gathers: dict = {}     # tensor kept as token pieces -> (1 iff re-gathered in the backward, its seconds)
    for k, (key, (held, chosen, _)) in enumerate(saves.items()):
        kept_var = problem.add_variable(f"a{k}", lowBound=0, upBound=1)  # 1 iff some chosen option keeps it
        problem += kept_var <= pulp.lpSum(chosen)
        for var in chosen:
            problem += kept_var >= var
        term = kept_var * w(key[0], 1) * held
        split = [v for v, s in zip(x.get(key[0], ()), ctx.strategies.get(key[0], ()), strict=True)
                 if on_tokens(key[0], s)]
        if split and key[1:] == ("value", 1.0):  # gathered from tokens: only this rank's piece is kept
            whole, piece = (problem.add_variable(f"a{k}{part}", lowBound=0) for part in "wp")
            problem += whole >= kept_var - pulp.lpSum(split)
            problem += piece >= kept_var + pulp.lpSum(split) - 1
            term = w(key[0], 1) * held * (whole + piece / t)
            gathers[key[0]] = (piece, {"bytes": held, "count": w(key[0], 1),
                                       "seconds": w(key[0], 1) * regather_time(held, t, topology)})
            costs.append(piece * gathers[key[0]][1]["seconds"])
        elif key in frees:  # kept unless its attention core is recomputed
            still = problem.add_variable(f"a{k}r", lowBound=0)
            problem += still >= kept_var - frees[key]
            term = w(key[0], 1) * held * still
        memory.append(term)
        kinds.setdefault("activations", []).append(term)
    if sequence_parallel and t > 1:  # one rank splits nothing
        _force_tokens(problem, ctx, x)
    for a, b in ties:
        for va, vb in zip(x.get(a, ()), x.get(b, ()), strict=True):
            problem += va == vb
    latency = collective_time("all_reduce", 0.0, t, topology)
    for k, (bias, weight) in enumerate(pairs.items()):  # one all-reduce sums a weight's and its bias's gradients
        summed = problem.add_variable(f"pair{k}", lowBound=0)
        for node in (bias, weight):
            for var, s in zip(x[node], ctx.strategies[node], strict=True):
                if isinstance(s.output, Shard) and s.output.grouped(t):
                    problem += summed >= var
        costs.append(summed * w(weight, 1) * latency)

    need: dict = {}        # (tensor, from, to) -> indicator that this reshard happens
    grad_reduce: dict = {}
    edges = []             # (producer, consumer choices [(var or 1, required placement)])
    for node, options in ctx.strategies.items():
        for slot_i, src in enumerate(input_slots(node)):
            if src in ctx.strategies and is_placed(src):
                edges.append((src, [(v, s.inputs[slot_i]) for v, s in zip(x[node], options, strict=True)]))
                bad = [v for v, s in zip(x[node], options, strict=True) if partial_grad(node, s, s.inputs[slot_i])]
                if src in grad and bad:
                    g = grad_reduce.setdefault(src, problem.add_variable(f"g{len(grad_reduce)}", lowBound=0))
                    problem += g >= pulp.lpSum(bad)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    returned = [src for src in input_slots(output)
                if src in ctx.strategies and is_placed(src) and not isinstance(src.meta.get("val"), (list, tuple))]
    if gather_outputs:
        edges += [(src, [(1, R)]) for src in returned]  # returned full on every rank
    else:  # shards stay where they are; partial sums are still reduced
        costs += [v * collective_time("all_reduce", sizes.nbytes(src), t, topology) for src in returned
                  for v, s in zip(x[src], ctx.strategies[src], strict=True) if isinstance(s.output, Partial)]
    stored = stored_views(gm)
    for e, (src, wanted) in enumerate(edges):
        produced = [(v, s.output) for v, s in zip(x[src], ctx.strategies[src], strict=True)]
        for (p, q), z in _link(problem, produced, wanted,
                               lambda p, q, s=src: _reshard_ok(s, s in stored, p, q, sizes, t, topology),
                               f"z{e}_").items():
            if p != q:
                key = (src, p, q)
                need.setdefault(key, problem.add_variable(f"n{len(need)}", lowBound=0))
                problem += need[key] >= z
    for (src, p, q), var in need.items():
        costs.append(var * w(src, 1) * conversion_seconds(p, q, src, sizes, t, topology, backward=src in grad))
    together = problem.add_variable("together", lowBound=0)  # replicated parameters' partial gradients: one latency
    costs.append(together * latency)
    for k, (src, g) in enumerate(grad_reduce.items()):
        summed = collective_time("all_reduce", sizes.nbytes(src), t, topology)
        if coalesced(src):  # summed with the others in one all-reduce (partial_params)
            problem += together >= g
            costs.append(g * w(src, 1) * (summed - latency))
            continue
        costs.append(g * w(src, 1) * summed)
        sharded = [v for v, s in zip(x[src], ctx.strategies[src], strict=True) if isinstance(s.output, Shard)]
        if sharded:  # gathered from shards: the summed gradient is reduce-scattered back instead
            h = problem.add_variable(f"h{k}", lowBound=0)
            problem += h <= g
            problem += h <= pulp.lpSum(sharded)
            costs.append(-h * w(src, 1) * (summed - collective_time("reduce_scatter", sizes.nbytes(src), t, topology)))

    limit = memory_limit if memory_limit is not None else 0.9 * topology.memory_bytes
    total_memory = pulp.lpSum(memory)
    objective = pulp.lpSum(costs + preference)
    _run(problem, objective)
    if pulp.value(total_memory) > limit:
        hint = _fit_hint(ctx, x, sizes, limit, trainable, training, w, grad)
        problem += total_memory <= limit, "memory_limit"
        try:
            _run(problem, objective)
        except PlanningError:
            raise DoesNotFit(f"no plan fits {limit / 1e9:.1f} GB per device at world size {t}: {hint}") from None
    seconds = float(pulp.value(pulp.lpSum(costs)))
    choice = {node: options[max(range(len(options)), key=lambda k: x[node][k].value() or 0)]
              for node, options in ctx.strategies.items()}
    by_kind = {kind: float(pulp.value(pulp.lpSum(terms)) or 0.0) for kind, terms in kinds.items()}
    recomputed = [core for core, r in zip(cores, again, strict=True) if pulp.value(r) > 0.5]
    by_kind["activations"] = sum(w(node, 1) * held for node, held in  # exact, whatever slack the ILP left
                                 activation_bytes(choice, sizes, t, grad, recomputed).items())
    regathers = {node: priced for node, (piece, priced) in gathers.items() if pulp.value(piece) > 0.5}
    return Solution(choice, seconds, float(pulp.value(pulp.lpSum(compute)) or 0.0), breakdown(by_kind), recomputed,
                    regathers)


def _force_tokens(problem: pulp.LpProblem, ctx: Context, x: dict) -> None:
    split = [node for node, options in ctx.strategies.items() if any(on_tokens(node, s) for s in options)]
    if not split:
        raise PlanningError("sequence_parallel=True, but no op can split the tokens: the inputs have no symbolic dim "
                            "after the first (export them with a dynamic sequence), or pass sequence_parallel=None")
    for node in split:
        for var, s in zip(x[node], ctx.strategies[node], strict=True):
            if s.output == R or isinstance(s.output, Partial):
                problem += var == 0


def _run(problem: pulp.LpProblem, objective) -> None:
    """Solve for the objective in microseconds: CBC's tolerances (~1e-7) would blur a step time in seconds."""
    problem.setObjective(objective * 1e6)
    with warnings.catch_warnings():  # PuLP 3 warns that 4.0 will stop bundling CBC; pyproject pins <4
        warnings.simplefilter("ignore", DeprecationWarning)
        problem.solve(pulp.PULP_CBC_CMD(msg=False))
    status = pulp.LpStatus[problem.status]
    if status != "Optimal":
        raise PlanningError(f"the sharding ILP ended {status}")


def _fit_hint(ctx: Context, x: dict, sizes: Sizes, limit: float, trainable: dict, training: bool, w,
              grad: set) -> str:
    """What would fit: the smallest world size for the current plan's memory, or the memory it needs."""
    replicated = sharded = 0.0
    activations: dict = {}
    for node, options in ctx.strategies.items():
        for var, s in zip(x[node], options, strict=True):
            if (var.value() or 0) > 0.5:
                held = w(node, 1) * sum(op_memory(node, s, sizes, ctx.world, trainable, training).values())
                split = isinstance(s.output, Shard) or (node.op != "get_attr" and not s.replicated)
                replicated += 0 if split else held
                sharded += held * ctx.world if split else 0
                activations.update(kept_bytes(node, s, sizes, ctx.world, grad))
    for (tensor, _, share), nbytes in activations.items():
        replicated += w(tensor, 1) * nbytes if share == 1 else 0
        sharded += w(tensor, 1) * nbytes * ctx.world if share < 1 else 0
    need = replicated + sharded / ctx.world
    fits = smallest_fitting_world(replicated, sharded, limit, [2 ** k for k in range(1, 11)])
    advice = f"try world size {fits}" if fits else "no world size helps: its replicated part alone is too large"
    return f"the best plan needs about {need / 1e9:.1f} GB per device; {advice}, or use devices with more memory"


def _link(problem, produced, wanted, ok, tag) -> dict:
    """z[p, q] >= 0 with row sums = producer picks p, column sums = consumer wants q.

    For binary choices this forces z = 1 exactly on the chosen pair (transport form),
    so one continuous variable per feasible pair prices the edge without products of binaries.
    """
    outs = list(dict.fromkeys(p for _, p in produced))
    ins = list(dict.fromkeys(q for _, q in wanted))
    z = {(p, q): problem.add_variable(f"{tag}{k}", lowBound=0)
         for k, (p, q) in enumerate((p, q) for p in outs for q in ins if ok(p, q))}
    for side, choices, key in ((0, produced, outs), (1, wanted, ins)):
        for placement in key:
            chosen = pulp.lpSum(v for v, pl in choices if pl == placement)
            problem += pulp.lpSum(var for pq, var in z.items() if pq[side] == placement) == chosen
    return z


def _reshard_ok(src, stored: bool, p, q, sizes: Sizes, world: int, topology: Topology) -> bool:
    if p == q:
        return True
    if stored and not (isinstance(p, Replicate) and isinstance(q, Shard)):
        return False  # parameters (and views of them) are stored as used; never gathered at run time
    return conversion_seconds(p, q, src, sizes, world, topology) is not None
