"""How each parameter is used, in words (column, row, vocab split, ...), read from the graph and the plan."""

from __future__ import annotations

import torch

from autotp.ops.table import op
from autotp.placement import Disjoint, Partial, Replicate, Routed, Shard


def _units_note(placement: Shard, size: int, world: int) -> str:
    """Call out shards that are not N equal slices: uneven heads or rows, KV heads shared by ranks,
    the KV heads each rank's query heads need, fused blocks dealt out by their own heads."""
    units = placement.units
    if units is None or units == world:
        return ""
    if placement.whole(world):
        return ", held whole by every rank"
    if isinstance(units, int) and placement.of is None:
        name = "heads" if units < size else "rows"
        if placement.grouped(world):
            return f", {units} {name} each replicated on {world // units} ranks"
        counts = [placement.local_size(size, r, world) * units // size for r in range(world)]
        return f", uneven {name}: {','.join(map(str, counts))} of {units}"
    notes = []
    for k in range(placement.count()):
        held = [placement.spans(r, world, k + 1)[k] for r in range(world)]
        text = "|".join({0: "-", 1: str(first)}.get(count, f"{first}-{first + count - 1}") for first, count in held)
        notes.append(f"heads {text} of {placement.parts(world, k)}")
    follows = f" (each rank holds what its share of {placement.of} query heads needs)" if placement.of else ""
    return ", " + "; ".join(notes) + follows


def _expert_style(node: torch.fx.Node, choice: dict, world: int) -> str | None:
    """A weight reaching an expert op through layout ops (a transpose, ``w[ids]``): whole experts dealt out
    to the ranks (expert parallelism: its users compute disjoint partial sums), or, for a 3-D weight (one
    matrix per expert), its experts split like a dense MLP's, by output columns or, with partial sums, by
    input rows."""
    work = list(node.users)
    while work:
        user = work.pop()
        out = choice[user].output if user in choice else None
        if isinstance(out, (Disjoint, Routed)):
            count = int(node.meta["val"].shape[0])
            held = (
                [out.owned(count, r, world) for r in range(world)]
                if isinstance(out, Disjoint)
                else [out.owned(count, r) for r in range(out.ranks)]
            )
            return (
                "experts "
                + "|".join(f"{a}" if n == 1 else f"{a}-{a + n - 1}" for a, n in held)
                + f" of {count} (whole experts by rank"
                + (", rows sent by all-to-all)" if isinstance(out, Routed) else ")")
            )
        if op(user.target).layout:
            work += user.users
        elif out is not None and not isinstance(out, Replicate) and len(node.meta["val"].shape) == 3:
            return "expert FFN " + ("row split" if isinstance(out, Partial) else "column split")
    return None


def param_styles(gm: torch.fx.GraphModule, choice: dict, world: int) -> dict:
    """parameter name -> 'column', 'row', 'replicate', ... from how its users compute with it."""
    styles = {}
    for node, strategy in choice.items():
        if node.op != "get_attr":
            continue
        placement = strategy.output
        style = (
            "replicate"
            if isinstance(placement, Replicate)
            else _expert_style(node, choice, world)
            if isinstance(placement, Routed)
            else f"shard dim {placement.dim}"
        )
        if isinstance(placement, Shard):
            for user in node.users:
                if user.args and node in user.args:
                    table = op(user.target).styles.get(list(user.args).index(node))
                    if table and placement.dim in table:
                        style = table[placement.dim]
                        break
            style = _expert_style(node, choice, world) or style
            if style in ("shard dim 0", "column") and len(node.meta["val"].shape) == 1:
                added = any(op(user.target).additive for user in node.users)
                style = "bias split" if added else "vector split"  # a bias, or a norm's scale
            if placement.chunks:
                groups = f" x {placement.groups} groups" if placement.groups else ""
                style += f" (fused {len(placement.chunks)} blocks{groups})"
            if not style.startswith("experts"):
                style += _units_note(placement, int(node.meta["val"].shape[placement.dim]), world)
        styles[node.target] = style
    return styles
