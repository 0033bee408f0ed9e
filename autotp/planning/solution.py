"""What the solver is given beyond the candidates and what it hands back: how a hand-written plan runs
(``Imposed``), the chosen strategies with their price (``Solution``), and the errors a solve ends with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.fx import GraphModule, Node

from autotp.ops.strategies import Strategy


class PlanningError(RuntimeError):
    pass


@dataclass(frozen=True)
class Imposed:
    """How a hand-written plan runs, beyond where it puts the parameters: ``conversions(producer, reader, have,
    want)`` says where a value may change placement (None: wherever a conversion exists); with
    ``grad_sums_per_reader`` each reader of a replicated value sums its own gradient (a hook per module), not one
    sum per value; ``sums_each_param``: each replicated parameter's partial gradient is its own all-reduce
    (DTensor sums a Partial gradient when it is read), not one coalesced sum; ``regathered``: the names of the
    gathered tokens kept as this rank's piece and gathered again, the others kept whole (a plan priced as it
    stands; empty: DTensor, which saves what it redistributed; None: the solver chooses each)."""

    conversions: Callable[[Node, Node, Any, Any], bool] | None = None
    grad_sums_per_reader: bool = False
    sums_each_param: bool = False
    regathered: frozenset[str] | None = None


def every_name(gm: GraphModule) -> frozenset[str]:
    """``Imposed.regathered`` as Megatron-SP runs: every gathered token tensor kept as this rank's piece."""
    return frozenset(node.name for node in gm.graph.nodes)


class DoesNotFit(PlanningError):
    """No plan among the options fits the memory limit."""


@dataclass
class Solution:
    choice: dict[Node, Strategy]
    seconds: float  # estimated step time of the chosen plan
    compute: float  # the ops' own part of it (recomputation and grouped weights' gradient sums included)
    memory: dict[str, float]  # estimated bytes per device by kind (cost_models.memory.breakdown)
    recomputed: list[list[Node]] = field(default_factory=list)  # attention cores whose backward computes them again
    # tensor kept as token pieces -> its backward re-gather's {"bytes", "count" (folded), "seconds" (all counts)}
    regathers: dict[Node, dict[str, float]] = field(default_factory=dict)
    # conversion (tensor, from, to) fused with its products (asynchronous TP) -> seconds fusing saves (all counts)
    overlap: dict[tuple[Node, Any, Any], float] = field(default_factory=dict)
