"""The sharding ILP under construction: one method per constraint family of planning/solve.py's math, each
adding its variables, constraints and objective terms to the one PuLP problem."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pulp
import torch
from torch.fx import Node

from autotp.cost_models import collective_time
from autotp.cost_models.memory import PEAK_KINDS, breakdown
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
from autotp.ops.semantics import shared_with_writes
from autotp.ops.strategies import input_slots, is_placed, needs_grad, on_tokens
from autotp.ops.table import stored_views
from autotp.options import PlanOptions
from autotp.passes.gradients import bias_weights, coalesced, partial_grad
from autotp.passes.recompute import dropped
from autotp.placement import Partial, R, Replicate, Shard
from autotp.planning.candidates import Candidates
from autotp.planning.fit_advice import fit_advice
from autotp.planning.pulp_forms import link_choices, run_problem
from autotp.planning.solution import DoesNotFit, Imposed, PlanningError, Solution

# Equal-cost plans are common (an all-gather before a matmul or a reduce-scatter after it move the
# same bytes); a tenth of a nanosecond per option index makes the solver prefer the rules' earlier
# options, so the same graph always gets the same plan, folded or whole.
TIE_BREAK = 1e-10
# Under a memory limit the choices that trade time for bytes (gathering tokens again, recomputing cores) form a
# knapsack whose bound CBC closes slowly when their ratios are alike: stop within this fraction of the best bound.
MEMORY_BOUND_GAP = 1e-3


class Ilp:
    """The problem under construction: the choice variables x and the objective's and memory's terms, by kind."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        found: Candidates,
        topology: Topology,
        options: PlanOptions,
        sizes: Sizes,
        weights: Mapping[Node, int],
        imposed: Imposed,
    ) -> None:
        self.gm, self.found, self.topology, self.sizes = gm, found, topology, sizes
        self.world, self.training, self.gather_outputs = found.world, options.training, options.gather_outputs
        self.weight = weights.get
        self.problem = pulp.LpProblem("autotp", pulp.LpMinimize)
        self.trainable = dict(gm.named_parameters(remove_duplicate=False))
        self.grad = needs_grad(gm) if self.training else set()
        self.costs: list[Any] = []  # PuLP expressions
        self.compute: list[Any] = []
        self.memory: list[Any] = []
        self.kinds: dict[str, list[Any]] = {}
        self.preference: list[Any] = []
        self.pairs = {
            b: a
            for b, a in bias_weights(gm).items()
            if self.training and {a, b} <= found.strategies.keys() and {a.target, b.target} <= self.trainable.keys()
        }
        self.x: dict[Node, list[Any]] = {}
        # kept tensor key -> (bytes, options that keep it, nodes)
        self.saves: dict[tuple[Any, ...], tuple[float, list[Any], set[Node]]] = {}
        self.latency = collective_time("all_reduce", 0.0, self.world, topology)
        self.imposed = imposed
        # edges() fills: (tensor, from, to) -> n, and per edge (producer, reader, slot, {(from, to): z})
        self.need: dict[tuple[Node, Any, Any], Any] = {}
        self.links: list[tuple[Node, Node, int | None, dict[tuple[Any, Any], Any]]] = []
        self.overlap: list[tuple[tuple[Node, Any, Any], Any]] = []  # conversion fused with products, seconds saved

    def choose_one(self) -> None:
        """x: one strategy per node; each brings its op time, its memory and its tie-break preference."""
        problem, t, w, sizes = self.problem, self.world, self.weight, self.sizes
        paired = set(self.pairs) | set(self.pairs.values())
        peaks: dict[str, dict[Node, list[Any]]] = {}
        for i, (node, options) in enumerate(self.found.strategies.items()):
            self.x[node] = [problem.add_variable(f"x{i}_{k}", cat="Binary") for k in range(len(options))]
            problem += pulp.lpSum(self.x[node]) == 1
            weight = w(node, 1)
            for k, (var, s) in enumerate(zip(self.x[node], options, strict=True)):
                self.compute.append(
                    var * weight * op_seconds(node, s, sizes, t, self.topology, self.training, node in paired)
                )
                self.preference.append(var * weight * k * TIE_BREAK)
                for kind, held in op_memory(node, s, sizes, t, self.trainable, self.training).items():
                    if held and kind in PEAK_KINDS:  # held while this op runs: its largest counts, once
                        peaks.setdefault(kind, {}).setdefault(node, []).append(var * held)
                    elif held:
                        term = var * weight * held
                        self.memory.append(term)
                        self.kinds.setdefault(kind, []).append(term)
                for key, held in kept_bytes(node, s, sizes, t, self.grad):
                    self.saves.setdefault(key, (held, [], set()))[1].append(var)
                    self.saves[key][2].add(node)
        for kind, by_node in peaks.items():
            peak = problem.add_variable(f"peak_{kind}", lowBound=0)
            for terms in by_node.values():
                problem += peak >= pulp.lpSum(terms)
            self.memory.append(peak)
            self.kinds[kind] = [peak]

    def recompute(self, cores: list[list[Node]], forced: bool, ties: Sequence[tuple[Node, Node]]) -> list[Any]:
        """r: one 0/1 choice per core (1 when ``forced``; tied cores of folded blocks alike), priced at the forward
        time of the core's ops under the options chosen for them, paid again in the backward."""
        problem, chosen = self.problem, []
        for k, core in enumerate(cores):
            r = problem.add_variable(f"r{k}", lowBound=int(forced), upBound=1, cat="Integer")
            chosen.append(r)
            for i, node in enumerate(core):
                for j, (var, s) in enumerate(
                    zip(self.x.get(node, ()), self.found.strategies.get(node, ()), strict=True)
                ):
                    both = problem.add_variable(f"r{k}_{i}_{j}", lowBound=0)  # var and r
                    problem += both >= var + r - 1
                    forward = (
                        self.weight(node, 1)
                        * op_seconds(node, s, self.sizes, self.world, self.topology, self.training)
                        / 3
                    )
                    self.compute.append(both * forward)
        by_last = {core[-1]: r for core, r in zip(cores, chosen, strict=True)}
        for a, b in ties:
            if a in by_last and b in by_last:
                problem += by_last[a] == by_last[b]
        self.costs += self.compute
        return chosen

    def activations(self, cores: list[list[Node]], again: list[Any]) -> dict[Node, tuple[Any, dict[str, float]]]:
        """a: each kept tensor held once if any chosen strategy keeps it; only this rank's piece of tokens that
        are all-gathered again in the backward (piece: the solver's choice for each gathered tensor, or the
        imposed one); nothing of what a recomputed core frees."""
        problem, w, t, found = self.problem, self.weight, self.world, self.found
        frees = {
            key: r
            for core, r in zip(cores, again, strict=True)
            for key in dropped({key: nodes for key, (_, _, nodes) in self.saves.items()}, core)
        }
        fixed = self.imposed.regathered  # names of the tensors a priced plan re-gathers, or None: chosen here
        # tensor kept as token pieces -> (1 iff re-gathered in the backward, its seconds)
        gathers: dict[Node, tuple[Any, dict[str, float]]] = {}
        for k, (key, (held, chosen, _)) in enumerate(self.saves.items()):
            kept_var = problem.add_variable(f"a{k}", lowBound=0, upBound=1)  # 1 iff some chosen option keeps it
            problem += kept_var <= pulp.lpSum(chosen)
            for var in chosen:
                problem += kept_var >= var
            term = kept_var * w(key[0], 1) * held
            split = [
                v
                for v, s in zip(self.x.get(key[0], ()), found.strategies.get(key[0], ()), strict=True)
                if on_tokens(key[0], s)
            ]
            if split and key[1:] == ("value", 1.0):
                # gathered from tokens: kept whole, or this rank's piece gathered again (costs time, saves memory)
                whole = problem.add_variable(f"a{k}w", lowBound=0)
                piece = problem.add_variable(f"a{k}p", cat="Binary")
                problem += whole >= kept_var - piece
                problem += piece <= pulp.lpSum(split)
                if fixed is not None and key[0].name in fixed:
                    problem += piece >= kept_var + pulp.lpSum(split) - 1
                elif fixed is not None:
                    problem += piece == 0
                term = w(key[0], 1) * held * (whole + piece / t)
                gathers[key[0]] = (
                    piece,
                    {
                        "bytes": held,
                        "count": w(key[0], 1),
                        "seconds": w(key[0], 1) * regather_time(held, t, self.topology),
                    },
                )
                self.costs.append(piece * gathers[key[0]][1]["seconds"])
            elif key in frees:  # kept unless its attention core is recomputed
                still = problem.add_variable(f"a{k}r", lowBound=0)
                problem += still >= kept_var - frees[key]
                term = w(key[0], 1) * held * still
            self.memory.append(term)
            self.kinds.setdefault("activations", []).append(term)
        return gathers

    def token_split(self) -> None:
        """Sequence parallelism imposed: no op that could split the tokens keeps its output whole or partial."""
        strategies = self.found.strategies
        split = [node for node, options in strategies.items() if any(on_tokens(node, s) for s in options)]
        if not split:
            raise PlanningError(
                "sequence_parallel=True, but no op can split the tokens: the inputs have no symbolic "
                "dim after the first (export them with a dynamic sequence), or pass "
                "sequence_parallel=None"
            )
        for node in split:
            for var, s in zip(self.x[node], strategies[node], strict=True):
                if s.output == R or isinstance(s.output, Partial):
                    self.problem += var == 0

    def tie(self, ties: Sequence[tuple[Node, Node]]) -> None:
        """Tied nodes (a folded block's stand-ins) choose alike."""
        for a, b in ties:
            for va, vb in zip(self.x.get(a, ()), self.x.get(b, ()), strict=True):
                self.problem += va == vb

    def bias_pairs(self) -> None:
        """One all-reduce sums a weight's and its bias's gradients: one latency for the pair."""
        for k, (bias, weight) in enumerate(self.pairs.items()):
            summed = self.problem.add_variable(f"pair{k}", lowBound=0)
            for node in (bias, weight):
                for var, s in zip(self.x[node], self.found.strategies[node], strict=True):
                    if isinstance(s.output, Shard) and s.output.grouped(self.world):
                        self.problem += summed >= var
            self.costs.append(summed * self.weight(weight, 1) * self.latency)

    def edges(self) -> dict[tuple[Node, Node | None], Any]:
        """z and n: what each reader needs of each value, converted once per (tensor, from, to); g: the values
        whose gradients ranks must sum.  Returns g."""
        problem, strategies, x, t, sizes = self.problem, self.found.strategies, self.x, self.world, self.sizes
        need = self.need  # (tensor, from, to) -> indicator that this reshard happens
        grad_reduce: dict[tuple[Node, Node | None], Any] = {}
        # (producer, reader, the reader's input slot, the reader's choices [(var or 1, required placement)])
        edges: list[tuple[Node, Node, int | None, list[tuple[Any, Any]]]] = []
        for node, options in strategies.items():
            for slot_i, src in enumerate(input_slots(node)):
                if src in strategies and is_placed(src):
                    wanted = [(v, s.inputs[slot_i]) for v, s in zip(x[node], options, strict=True)]
                    edges.append((src, node, slot_i, wanted))
                    bad = [v for v, s in zip(x[node], options, strict=True) if partial_grad(node, s, s.inputs[slot_i])]
                    if src in self.grad and bad:
                        key: tuple[Any, ...] = (src, node) if self.imposed.grad_sums_per_reader else (src, None)
                        g = grad_reduce.setdefault(key, problem.add_variable(f"g{len(grad_reduce)}", lowBound=0))
                        problem += g >= pulp.lpSum(bad)
        output = next(n for n in self.gm.graph.nodes if n.op == "output")
        returned = [
            src
            for src in input_slots(output)
            if src in strategies and is_placed(src) and not isinstance(src.meta.get("val"), (list, tuple))
        ]
        if self.gather_outputs:
            edges += [(src, output, None, [(1, R)]) for src in returned]  # returned full on every rank
        else:  # shards stay where they are; partial sums are still reduced
            self.costs += [
                v * collective_time("all_reduce", sizes.nbytes(src), t, self.topology)
                for src in returned
                for v, s in zip(x[src], strategies[src], strict=True)
                if isinstance(s.output, Partial)
            ]
        stored, written, allowed = stored_views(self.gm), shared_with_writes(self.gm), self.imposed.conversions
        for e, (src, reader, slot, wanted) in enumerate(edges):
            produced = [(v, s.output) for v, s in zip(x[src], strategies[src], strict=True)]
            links = link_choices(
                problem,
                produced,
                wanted,
                lambda p, q, s=src, r=reader: (
                    p == q
                    or (
                        s not in written
                        and _reshard_ok(s, s in stored, p, q, sizes, t, self.topology)
                        and (allowed is None or allowed(s, r, p, q))
                    )
                ),
                f"z{e}_",
            )
            self.links.append((src, reader, slot, links))
            for (p, q), z in links.items():
                if p != q:
                    key = (src, p, q)
                    need.setdefault(key, problem.add_variable(f"n{len(need)}", lowBound=0, upBound=1))
                    problem += need[key] >= z
        for (src, p, q), var in need.items():
            self.costs.append(
                var
                * self.weight(src, 1)
                * conversion_seconds(p, q, src, sizes, t, self.topology, backward=src in self.grad)
            )
        return grad_reduce

    def gradient_sums(self, grad_reduce: dict[tuple[Node, Node | None], Any]) -> None:
        """g's price: an all-reduce of the gradient (replicated parameters' together, one latency), or a
        reduce-scatter where the value was gathered from shards."""
        problem, w, t, sizes, latency = self.problem, self.weight, self.world, self.sizes, self.latency
        together = problem.add_variable("together", lowBound=0)
        self.costs.append(together * latency)
        for k, ((src, _), g) in enumerate(grad_reduce.items()):
            summed = collective_time("all_reduce", sizes.nbytes(src), t, self.topology)
            if coalesced(src) and not self.imposed.sums_each_param:  # one all-reduce with the others (partial_params)
                problem += together >= g
                self.costs.append(g * w(src, 1) * (summed - latency))
                continue
            self.costs.append(g * w(src, 1) * summed)
            sharded = [
                v for v, s in zip(self.x[src], self.found.strategies[src], strict=True) if isinstance(s.output, Shard)
            ]
            if sharded:  # gathered from shards: the summed gradient is reduce-scattered back instead
                h = problem.add_variable(f"h{k}", lowBound=0)
                problem += h <= g
                problem += h <= pulp.lpSum(sharded)
                self.costs.append(
                    -h * w(src, 1) * (summed - collective_time("reduce_scatter", sizes.nbytes(src), t, self.topology))
                )

    def minimise(self, limit: float) -> None:
        """The fastest plan; if it does not fit ``limit``, the fastest that does (or DoesNotFit with advice)."""
        total_memory = pulp.lpSum(self.memory)
        objective = pulp.lpSum(self.costs + self.preference)
        run_problem(self.problem, objective)
        if pulp.value(total_memory) > limit:
            hint = fit_advice(
                self.found,
                self.x,
                self.sizes,
                limit,
                self.trainable,
                self.training,
                self.weight,
                self.grad,
                self.topology.gpus_per_node,
            )
            self.problem += total_memory <= limit, "memory_limit"
            try:
                run_problem(self.problem, objective, MEMORY_BOUND_GAP)
            except PlanningError:
                raise DoesNotFit(
                    f"no plan fits {limit / 1e9:.1f} GB per device at world size {self.world}: {hint}"
                ) from None

    def solution(
        self, cores: list[list[Node]], again: list[Any], gathers: dict[Node, tuple[Any, dict[str, float]]]
    ) -> Solution:
        x, w = self.x, self.weight
        seconds = float(pulp.value(pulp.lpSum(self.costs)))
        choice = {
            node: options[max(range(len(options)), key=lambda k: x[node][k].value() or 0)]
            for node, options in self.found.strategies.items()
        }
        by_kind = {kind: float(pulp.value(pulp.lpSum(terms)) or 0.0) for kind, terms in self.kinds.items()}
        recomputed = [core for core, r in zip(cores, again, strict=True) if pulp.value(r) > 0.5]
        regathers = {node: priced for node, (piece, priced) in gathers.items() if pulp.value(piece) > 0.5}
        by_kind["activations"] = sum(
            w(node, 1) * held
            for node, held in activation_bytes(  # exact, whatever slack the ILP left
                choice, self.sizes, self.world, self.grad, recomputed, regathers
            ).items()
        )
        fused = [(key, w(key[0], 1) * float(pulp.value(saved))) for key, saved in self.overlap]
        return Solution(
            choice,
            seconds,
            float(pulp.value(pulp.lpSum(self.compute)) or 0.0),
            breakdown(by_kind),
            recomputed,
            regathers,
            {key: saved for key, saved in fused if pulp.value(self.need[key]) > 0.5},
        )


def _reshard_ok(src: Node, stored: bool, p: Any, q: Any, sizes: Sizes, world: int, topology: Topology) -> bool:
    if p == q:
        return True
    if stored and not (isinstance(p, Replicate) and isinstance(q, Shard)):
        return False  # parameters (and views of them) are stored as used; never gathered at run time
    return conversion_seconds(p, q, src, sizes, world, topology) is not None
