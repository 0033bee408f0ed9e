"""What would fit when no plan does: the smallest world size for the plan the solver found, or the memory it
needs; beyond a node, the ``autotp mesh`` command that lays the rest out over nodes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch.fx import Node

from autotp.cost_models.memory import PEAK_KINDS, smallest_fitting_world
from autotp.cost_models.pricing import Sizes, kept_bytes, op_memory
from autotp.placement import Shard
from autotp.planning.candidates import Candidates


def fit_advice(
    ctx: Candidates,
    x: Mapping[Node, list[Any]],
    sizes: Sizes,
    limit: float,
    trainable: dict[str, Any],
    training: bool,
    w: Callable[[Node, int], float],
    grad: set[Node],
    per_node: int,
) -> str:
    """What would fit: the smallest world size for the current plan's memory, or the memory it needs."""
    replicated = sharded = peak = 0.0
    activations: dict[tuple[Any, ...], float] = {}
    for node, options in ctx.strategies.items():
        for var, s in zip(x[node], options, strict=True):
            if (var.value() or 0) > 0.5:
                by_kind = op_memory(node, s, sizes, ctx.world, trainable, training)
                held = w(node, 1) * sum(v for k, v in by_kind.items() if k not in PEAK_KINDS)
                peak = max([peak, *(v for k, v in by_kind.items() if k in PEAK_KINDS)])  # one op's, not summed
                split = isinstance(s.output, Shard) or (node.op != "get_attr" and not s.replicated)
                replicated += 0 if split else held
                sharded += held * ctx.world if split else 0
                activations.update(kept_bytes(node, s, sizes, ctx.world, grad))
    for (tensor, _, share), nbytes in activations.items():
        replicated += w(tensor, 1) * nbytes if share == 1 else 0
        sharded += w(tensor, 1) * nbytes * ctx.world if share < 1 else 0
    sharded += peak * ctx.world  # this rank's share of the largest temporary, split like the heads
    need = replicated + sharded / ctx.world
    fits = smallest_fitting_world(replicated, sharded, limit, [2**k for k in range(1, 11)])
    advice = f"try world size {fits}" if fits else "no world size helps: its replicated part alone is too large"
    if fits and fits > per_node:  # TP stays inside a node: the rest is pipeline or data parallelism
        advice += (
            f" (more than a node's {per_node} devices: `autotp mesh MODEL --nodes {-(-fits // per_node)}` "
            "lays out TP inside a node, pipeline and data parallelism across)"
        )
    return f"the best plan needs about {need / 1e9:.1f} GB per device; {advice}, or use devices with more memory"
