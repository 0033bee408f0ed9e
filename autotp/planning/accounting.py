"""What a chosen plan costs, for reports: the collectives it inserts, and for every op the
alternatives the solver had, each priced with its neighbours' choices fixed."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node

from autotp.canonicalize.graph_edits import module_path
from autotp.cost_models import collective_time
from autotp.cost_models.communication import backward_collective, reshard_collective
from autotp.cost_models.pricing import Sizes, conversion_seconds, kept_bytes, op_seconds, regather_time
from autotp.cost_models.topology import Topology
from autotp.ops.strategies import Strategy, input_slots, is_placed, needs_grad, on_tokens
from autotp.passes.gradients import gradient_sums, partial_grad, partial_params
from autotp.passes.kept_tensors import kept, kept_gathered, kept_whole
from autotp.placement import R, Routed, Shard, dump

if TYPE_CHECKING:
    from autotp.ops.expert_segments import Segment
    from autotp.planning.candidates import Candidates

Choice = dict[Node, Strategy]  # node -> the strategy a plan gives it


def planned_collectives(
    gm: torch.fx.GraphModule,
    choice: Choice,
    world: int,
    topology: Topology,
    sizes: Sizes | None = None,
    weights: Mapping[Node, int] | None = None,
    training: bool = True,
    per_reader: bool = False,
    regathered: Collection[Node] = (),
    coalesce: bool = True,
) -> list[dict[str, Any]]:
    """The collectives the rewriter will insert for ``choice`` (one per tensor and target placement;
    ``count``: how many real tensors a folded graph's node stands for; ``regather``: a backward all-gather of
    tokens kept as this rank's piece, runtime/activations.py, for the tensors the plan ``regathered``;
    ``tensors``: the replicated parameters whose partial gradients one all-reduce sums,
    passes/gradients.partial_params); an inference plan (``training=False``) lists the forward's alone;
    ``per_reader`` and ``coalesce``: as solution.Imposed's grad_sums_per_reader and not sums_each_param."""
    grad = needs_grad(gm)
    # ranks sharing a unit sum its gradient (a bias with its weight)
    found: dict[tuple[Any, ...], tuple[Any, ...]] = {
        (members[0], "group"): ("backward", "all_reduce") for members in gradient_sums(gm, choice, world)
    }
    pieces = kept_gathered(choice, grad) & set(regathered)
    routed: list[tuple[Node, Any, Any]] = []  # (tensor, have, want) entering or leaving a routed segment
    together = partial_params(gm, choice, grad) if coalesce else []  # one all-reduce a list (of a dtype)
    alone = {member for members in together for member in members}
    for node in gm.graph.nodes:
        strategy = choice.get(node)
        wants = strategy.inputs if strategy is not None else [R] * len(input_slots(node))
        if node.op != "output" and strategy is None:
            continue
        for src, want in zip(input_slots(node), wants, strict=True):
            if src not in choice or want is None or isinstance(choice[src].output, tuple):
                continue
            have = choice[src].output
            if isinstance(have, Routed) or isinstance(want, Routed):
                if have != want:
                    routed.append((src, have, want))
                continue
            op = reshard_collective(have, want)
            if op:
                found.setdefault((src, have, want), ("forward", op))
            if op == "all_gather" and src in pieces:  # kept as this rank's tokens: gathered again
                found.setdefault((src, have, want, "again"), ("backward", "all_gather", {"regather": True}))
            back = backward_collective(have, want)
            if back and src in grad:
                found.setdefault((src, have, want, "back"), ("backward", back))
            if strategy is not None and partial_grad(node, strategy, want) and src in grad and src not in alone:
                # partial gradients summed: a reduce-scatter where the input was gathered from shards
                found.setdefault(
                    (src, want, "grad", node if per_reader else None),
                    ("backward", "reduce_scatter" if isinstance(have, Shard) else "all_reduce"),
                )
    sizes = sizes or Sizes()
    count = (weights or {}).get
    listed = [
        {
            "op": op,
            "phase": phase,
            "tensor": src.name,
            "module": _module(src),
            "bytes": sizes.nbytes(src),
            "seconds": collective_time(op, sizes.nbytes(src), world, topology),
            "count": count(src, 1),
            **(mark[0] if mark else {}),
        }
        for (src, *_), (phase, op, *mark) in found.items()
    ]
    listed += _dispatched(gm, choice, routed, world, topology, sizes, count, grad)
    for members in together:
        nbytes = sum(count(m, 1) * sizes.nbytes(m) for m in members)
        listed.append(
            {
                "op": "all_reduce",
                "phase": "backward",
                "tensor": members[0].name,
                "module": _module(members[0]),
                "bytes": nbytes,
                "count": 1,
                "seconds": collective_time("all_reduce", nbytes, world, topology),
                "tensors": [m.name for m in members],
            }
        )
    return listed if training else [c for c in listed if c["phase"] == "forward"]  # inference runs no backward


def _dispatched(
    gm: torch.fx.GraphModule,
    choice: Choice,
    routed: list[tuple[Node, Any, Any]],
    world: int,
    topology: Topology,
    sizes: Sizes,
    count: Callable[[Node, int], int],
    grad: set[Node],
) -> list[dict[str, Any]]:
    """The all-to-alls of expert segments (runtime/expert_dispatch.py): a routed segment's row counts, each row
    tensor's dispatch and the exit's combine (with the all-gather among TP ranks holding the same tokens,
    and the gathered gradient of the rows they sent); a segment dispatched over a mesh's "ep" ranks the
    same all-to-alls over them."""
    experts = sizes.experts
    found: list[dict[str, Any]] = []

    def add(op: str, phase: str, src: Node, nbytes: float, ranks: int, group: str, **extra: Any) -> None:
        found.append(
            {
                "op": op,
                "phase": phase,
                "tensor": src.name,
                "module": _module(src),
                "bytes": nbytes,
                "seconds": collective_time(op, nbytes, ranks, topology),
                "count": count(src, 1),
                "group": group,
                **extra,
            }
        )

    segments = set(experts.segments.values())
    for segment in sorted(segments, key=lambda s: s.exit.name):
        exit_placement = choice[segment.exit].output
        if isinstance(exit_placement, Routed):
            ranks, copies, group = exit_placement.ranks, world, "ep x tp" if experts.ep > 1 else "tp"
            entries = [
                (src, have)
                for src, have, want in routed
                if isinstance(want, Routed) and src not in experts.segments and _feeds(src, segment)
            ]
        elif experts.ep > 1:
            ranks, copies, group = experts.ep, 1, "ep"
            inside = set(segment.nodes)
            entries = [
                (a, None)
                for a in dict.fromkeys(a for n in segment.nodes for a in n.all_input_nodes)
                if a not in inside and a is not segment.key and a not in experts.segments
            ]
        else:
            continue
        add("all_to_all", "forward", segment.key, 8.0 * segment.experts, ranks, group, counts=True)
        for src, _ in entries:
            nbytes = sizes.nbytes(src) / copies
            add("all_to_all", "forward", src, nbytes, ranks, group)
            if src in grad:
                add("all_to_all", "backward", src, nbytes, ranks, group)
                if copies > 1:
                    add("all_gather", "backward", src, sizes.nbytes(src), copies, "tp")
        nbytes = sizes.nbytes(segment.exit) / copies
        add("all_to_all", "forward", segment.exit, nbytes, ranks, group)
        if copies > 1:
            add("all_gather", "forward", segment.exit, sizes.nbytes(segment.exit), copies, "tp")
        if segment.exit in grad:
            add("all_to_all", "backward", segment.exit, nbytes, ranks, group)
    return found


def _feeds(src: torch.fx.Node, segment: Segment) -> bool:
    return any(user in segment.nodes for user in src.users)


def _module(node: torch.fx.Node) -> str:
    """The module a tensor belongs to: its producer's, or for a parameter its owner's."""
    return module_path(node) or (str(node.target).rpartition(".")[0] if node.op == "get_attr" else "")


def alternatives(
    gm: torch.fx.GraphModule,
    ctx: Candidates,
    choice: Choice,
    topology: Topology,
    training: bool,
    sizes: Sizes | None = None,
    regathered: Collection[Node] = (),
) -> dict[str, list[dict[str, Any]]]:
    """node name -> [{"in", "out", "seconds", "kept", "chosen"}] for ops that had a choice, cheapest first
    (``kept``: bytes per device its backward keeps under that option).

    Each alternative is priced as if only this op changed: its compute plus the conversions from its
    producers' chosen placements and into its users' chosen ones (None where impossible), and the backward
    re-gather of a tensor it splits by tokens or keeps gathered from tokens (sequence parallelism), where the plan
    ``regathered`` it (the others are kept whole).
    """
    sizes = sizes or Sizes()
    world = ctx.world
    grad = needs_grad(gm) if training else set()
    users_of: dict[Node, list[Any]] = {}
    for node in gm.graph.nodes:
        wants = choice[node].inputs if node in choice else [R] * len(input_slots(node))
        if node in choice or node.op == "output":
            for src, want in zip(input_slots(node), wants, strict=True):
                if src in choice and is_placed(src) and want is not None:
                    users_of.setdefault(src, []).append(want)
    whole = kept_whole(choice, grad)
    out = {}
    for node, options in ctx.strategies.items():
        if len(options) < 2:
            continue
        priced = []
        for s in options:
            total: float | None = op_seconds(node, s, sizes, world, topology, training)
            moves = [
                (choice[src].output, want, src)
                for src, want in zip(input_slots(node), s.inputs, strict=True)
                if src in choice and is_placed(src) and want is not None
            ]
            moves += [(s.output, want, node) for want in users_of.get(node, [])]
            for have, want, tensor in moves:
                t = conversion_seconds(have, want, tensor, sizes, world, topology)
                total = None if t is None or total is None else total + t
            for tensor in _regathered_near(node, s, choice, whole, grad, regathered):
                total = None if total is None else total + regather_time(sizes.nbytes(tensor), world, topology)
            held = sum(held for _, held in kept_bytes(node, s, sizes, world, grad))
            priced.append(
                {
                    "in": [dump(p) for p in s.inputs],
                    "out": dump(s.output),
                    "seconds": total,
                    "kept": held,
                    "chosen": s == choice[node],
                }
            )
        out[node.name] = sorted(priced, key=lambda a: (a["seconds"] is None, a["seconds"] or 0.0))
    return out


def _regathered_near(
    node: torch.fx.Node,
    strategy: Strategy,
    choice: Choice,
    whole: Mapping[Node, set[Node]],
    grad: set[Node],
    regathered: Collection[Node],
) -> list[Node]:
    """The tensors of the plan's ``regathered`` that ``node`` produces or keeps and that would still be re-gathered
    in the backward, were it to take ``strategy`` with every other op as chosen (``whole``: kept_whole of the
    chosen plan)."""
    keeps = {item.tensor for item in kept(node, strategy, grad) if item.kind == "value" and item.placement == R}
    # in graph order (fx nodes compare by position): the seconds summed are the same in every process
    found: dict[Node, None] = {}
    for tensor in sorted(keeps | {node}):
        producer = strategy if tensor is node else choice.get(tensor)
        keepers = (whole.get(tensor, set()) - {node}) | ({node} & keeps)
        if tensor in regathered and producer is not None and keepers and on_tokens(tensor, producer):
            found[tensor] = None
    return list(found)
