"""Human-readable views of a plan (rich tables); decisions are described from the graph."""
from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from .placement import Replicate, Shard
from .plan import Plan

aten = torch.ops.aten
# (op, operand index) -> {sharded dim: style}, for a weight consumed directly by the op
_STYLES = {
    (aten.linear.default, 1): {0: "column", 1: "row"},
    (aten.mm.default, 1): {1: "column", 0: "row"},
    (aten.embedding.default, 0): {1: "hidden split", 0: "vocab split"},
}


def param_styles(gm: torch.fx.GraphModule, choice: dict) -> dict:
    """parameter name -> 'column', 'row', 'replicate', ... from how its users compute with it."""
    styles = {}
    for node, strategy in choice.items():
        if node.op != "get_attr":
            continue
        placement = strategy.output
        style = "replicate" if isinstance(placement, Replicate) else f"shard dim {placement.dim}"
        if isinstance(placement, Shard):
            for user in node.users:
                if user.args and node in user.args:
                    table = _STYLES.get((user.target, list(user.args).index(node)))
                    if table and placement.dim in table:
                        style = table[placement.dim]
                        break
            if style in ("shard dim 0", "column") and len(node.meta["val"].shape) == 1:
                style = "bias split"
            if placement.chunks:
                style += f" (fused {len(placement.chunks)} blocks)"
        styles[node.target] = style
    return styles


def tensor_shapes(model: torch.nn.Module) -> dict:
    """Full shapes of every parameter and buffer, by every name they have."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {name: tuple(t.shape) for name, t in named}


def plan_table(plan: Plan, shapes: dict | None = None) -> Table:
    table = Table(title=f"autotp plan: {plan.world_size} ranks, topology {plan.topology}")
    for column in ("parameter", "decision", "placement", "local shape"):
        table.add_column(column)
    for name in sorted(plan.params):
        placement = plan.placement(name)
        local = "?"
        if shapes and name in shapes:
            dims = list(shapes[name])
            if isinstance(placement, Shard):
                dims[placement.dim] //= plan.world_size
            local = "x".join(map(str, dims))
        table.add_row(name, plan.styles.get(name, ""), str(placement), local)
    return table


def collectives_table(plan: Plan) -> Table:
    table = Table(title="collectives per step")
    for column in ("phase", "op", "after module", "bytes", "est. µs"):
        table.add_column(column)
    for c in plan.collectives:
        table.add_row(c["phase"], c["op"], c["module"] or c["tensor"], f"{c['bytes']:.0f}", f"{c['seconds'] * 1e6:.1f}")
    return table


def print_plan(plan: Plan, shapes: dict | None = None, console: Console | None = None) -> None:
    console = console or Console(width=140)
    console.print(plan_table(plan, shapes))
    console.print(collectives_table(plan))
    console.print(memory_table(plan))
    console.print(f"estimated {'training step' if plan.cost.get('training') else 'forward'} time "
                  f"{plan.cost.get('seconds', 0) * 1e6:.1f} µs per device")


def memory_table(plan: Plan) -> Table:
    table = Table(title="memory per device (estimated)")
    table.add_column("kind")
    table.add_column("MB", justify="right")
    for kind, held in plan.cost.get("memory", {}).items():
        table.add_row(kind, f"{held / 1e6:.3f}")
    return table
