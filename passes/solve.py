"""Choose one strategy per node with an ILP (PuLP + bundled CBC).

The objective is estimated time per training step: compute (divided by N when sharded) +
resharding collectives (each (tensor, target placement) paid once, however many users share it) +
the backward all-reduce that a replicated input of a sharded op needs (Megatron's ``f``).
Memory enters through the parameter options (strategies.py): large parameters are only offered
sharded, so no global memory constraint couples the blocks and CBC stays fast.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import pulp
import torch
from torch.fx import Node

from autotp.cost_models import collective_time, reshard_time
from autotp.cost_models.topology import Topology
from autotp.placement import R, Replicate, Shard

from .strategies import Context, input_slots, is_placed

_MATMULS = {torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.matmul.default, torch.ops.aten.scaled_dot_product_attention.default}


class PlanningError(RuntimeError):
    pass


@dataclass
class Solution:
    choice: dict          # node -> Strategy
    seconds: float        # estimated step time of the chosen plan
    param_bytes: float    # parameter bytes held per device


def concrete(size) -> int:
    return size if isinstance(size, int) else int(size.node.hint or 1)


def nbytes(node: Node) -> float:
    v = node.meta.get("val")
    vals = v if isinstance(v, (list, tuple)) else [v]
    return float(sum(math.prod(concrete(s) for s in t.shape) * t.element_size()
                     for t in vals if isinstance(t, torch.Tensor)))


def flops(node: Node) -> float:
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor):
        return 0.0
    numel = math.prod(concrete(s) for s in out.shape)
    if node.target in _MATMULS:
        a = node.args[0].meta["val"]
        return 2.0 * numel * concrete(a.shape[-1])
    return float(numel)


def needs_grad(gm: torch.fx.GraphModule) -> set:
    """Nodes whose value depends on a trainable parameter (their gradients flow)."""
    params = {name for name, p in gm.named_parameters() if p.requires_grad}
    grad: set = set()
    for node in gm.graph.nodes:
        if (node.op == "get_attr" and node.target in params) or any(a in grad for a in node.all_input_nodes):
            grad.add(node)
    return grad


def solve(gm: torch.fx.GraphModule, ctx: Context, topology: Topology, *, training: bool = True) -> Solution:
    t = ctx.world
    problem = pulp.LpProblem("autotp", pulp.LpMinimize)
    costs = []
    x = {}
    for i, (node, options) in enumerate(ctx.strategies.items()):
        x[node] = [problem.add_variable(f"x{i}_{k}", cat="Binary") for k in range(len(options))]
        problem += pulp.lpSum(x[node]) == 1
        work = flops(node) / topology.peak_flops
        for var, s in zip(x[node], options, strict=True):
            costs.append(var * (work if s.replicated else work / t))

    trainable = dict(gm.named_parameters(remove_duplicate=False))  # buffers are derived constants: not counted
    param_bytes = {n: nbytes(n) for n in ctx.strategies if n.op == "get_attr" and n.target in trainable}
    memory = pulp.lpSum(var * (size if isinstance(s.output, Replicate) else size / t)
                        for node, size in param_bytes.items()
                        for var, s in zip(x[node], ctx.strategies[node], strict=True))

    grad = needs_grad(gm) if training else set()
    need: dict = {}        # (tensor, from, to) -> indicator that this reshard happens
    grad_reduce: dict = {}
    edges = []             # (producer, consumer choices [(var or 1, required placement)])
    for node, options in ctx.strategies.items():
        for slot_i, src in enumerate(input_slots(node)):
            if src in ctx.strategies and is_placed(src):
                edges.append((src, [(v, s.inputs[slot_i]) for v, s in zip(x[node], options, strict=True)]))
                bad = [v for v, s in zip(x[node], options, strict=True) if s.inputs[slot_i] == R and not s.replicated]
                if src in grad and bad:
                    g = grad_reduce.setdefault(src, problem.add_variable(f"g{len(grad_reduce)}", lowBound=0))
                    problem += g >= pulp.lpSum(bad)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    edges += [(src, [(1, R)]) for src in input_slots(output)   # returned full on every rank
              if src in ctx.strategies and is_placed(src) and not isinstance(src.meta.get("val"), (list, tuple))]
    for e, (src, wanted) in enumerate(edges):
        produced = [(v, s.output) for v, s in zip(x[src], ctx.strategies[src], strict=True)]
        for (p, q), z in _link(problem, produced, wanted, lambda p, q, s=src: _reshard_ok(s, p, q, t, topology),
                               f"z{e}_").items():
            if p != q:
                key = (src, p, q)
                need.setdefault(key, problem.add_variable(f"n{len(need)}", lowBound=0))
                problem += need[key] >= z
    for (src, p, q), var in need.items():
        costs.append(var * reshard_time(p, q, nbytes(src), t, topology, backward=src in grad))
    for src, g in grad_reduce.items():
        costs.append(g * collective_time("all_reduce", nbytes(src), t, topology))

    _run(problem, pulp.lpSum(costs))
    choice = {node: options[max(range(len(options)), key=lambda k: x[node][k].value() or 0)]
              for node, options in ctx.strategies.items()}
    return Solution(choice, float(pulp.value(problem.objective)), float(pulp.value(memory) or 0.0))


def _run(problem: pulp.LpProblem, objective) -> float:
    problem.setObjective(objective)
    with warnings.catch_warnings():  # PuLP 3 warns that 4.0 will stop bundling CBC; pyproject pins <4
        warnings.simplefilter("ignore", DeprecationWarning)
        problem.solve(pulp.PULP_CBC_CMD(msg=False))
    status = pulp.LpStatus[problem.status]
    if status != "Optimal":
        raise PlanningError(f"the sharding ILP ended {status}; this is a bug in autotp's rules, please report it")
    return float(pulp.value(objective))


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


def _reshard_ok(src: Node, p, q, world: int, topology: Topology) -> bool:
    if p == q:
        return True
    if src.op == "get_attr" and not (isinstance(p, Replicate) and isinstance(q, Shard)):
        return False  # parameters are stored as used; never gathered at run time
    return reshard_time(p, q, 1.0, world, topology) is not None


def planned_collectives(gm: torch.fx.GraphModule, choice: dict, world: int, topology: Topology) -> list[dict]:
    """The collectives the rewriter will insert for ``choice`` (one per tensor and target placement)."""
    from autotp.cost_models.collectives import backward_collective, reshard_collective

    from .capture import module_path

    grad = needs_grad(gm)
    found: dict = {}
    for node in gm.graph.nodes:
        strategy = choice.get(node)
        wants = strategy.inputs if strategy is not None else [R] * len(input_slots(node))
        if node.op != "output" and strategy is None:
            continue
        for src, want in zip(input_slots(node), wants, strict=True):
            if src not in choice or want is None or isinstance(choice[src].output, tuple):
                continue
            have = choice[src].output
            op = reshard_collective(have, want)
            if op:
                found.setdefault((src, have, want), ("forward", op))
            back = backward_collective(have, want)
            if back and src in grad:
                found.setdefault((src, have, want, "back"), ("backward", back))
            if strategy is not None and isinstance(want, Replicate) and not strategy.replicated and src in grad:
                found.setdefault((src, want, "grad"), ("backward", "all_reduce"))
    return [{"op": op, "phase": phase, "tensor": src.name, "module": module_path(src), "bytes": nbytes(src),
             "seconds": collective_time(op, nbytes(src), world, topology)}
            for (src, *_), (phase, op) in found.items()]
