"""The sharding ILP's generic PuLP pieces: the transport form that links a producer's choice to a consumer's, and
the solve in microseconds."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pulp

from autotp.planning.solution import PlanningError


def run_problem(problem: pulp.LpProblem, objective: Any, gap: float | None = None) -> None:
    """Solve for the objective in microseconds: CBC's tolerances (~1e-7) would blur a step time in seconds.
    ``gap``: stop at a solution within this fraction of the best bound (None: CBC's default)."""
    problem.setObjective(objective * 1e6)
    with warnings.catch_warnings():  # PuLP 3 warns that 4.0 will stop bundling CBC; pyproject pins <4
        warnings.simplefilter("ignore", DeprecationWarning)
        problem.solve(pulp.PULP_CBC_CMD(msg=False, gapRel=gap))
    status = pulp.LpStatus[problem.status]
    if status != "Optimal":
        raise PlanningError(f"the sharding ILP ended {status}")


def link_choices(
    problem: pulp.LpProblem,
    produced: list[tuple[Any, Any]],
    wanted: list[tuple[Any, Any]],
    ok: Callable[..., bool],
    tag: str,
) -> dict[tuple[Any, Any], Any]:
    """z[p, q] >= 0 with row sums = producer picks p, column sums = consumer wants q.

    For binary choices this forces z = 1 exactly on the chosen pair (transport form),
    so one continuous variable per feasible pair prices the edge without products of binaries.
    """
    outs = list(dict.fromkeys(p for _, p in produced))
    ins = list(dict.fromkeys(q for _, q in wanted))
    z = {
        (p, q): problem.add_variable(f"{tag}{k}", lowBound=0)
        for k, (p, q) in enumerate((p, q) for p in outs for q in ins if ok(p, q))
    }
    for side, choices, key in ((0, produced, outs), (1, wanted, ins)):
        for placement in key:
            chosen = pulp.lpSum(v for v, pl in choices if pl == placement)
            problem += pulp.lpSum(var for pq, var in z.items() if pq[side] == placement) == chosen
    return z
