"""Sequence-parallel checks shared by tests/test_sequence_parallel.py and tests/test_recompute.py."""

from __future__ import annotations

import torch
from torch.distributed.tensor.debug import CommDebugMode

import autotp
from autotp.options import PlanOptions
from autotp.passes.prepared_graph import prepared_graph
from autotp.plan import Plan
from autotp.planning.tensor_plan import price_plan, solve_plan
from tests.helpers.distributed import comm_counts, plan_ops
from tests.helpers.exact import TOL
from tests.helpers.models import logits

# priced at 4096 tokens: bytes decide (at a few hundred tokens of these tiny models latency does, and a
# one-shot all-reduce beats a reduce-scatter)
EXAMPLE = (64, 64)


def regathering_all(plan: Plan) -> Plan:
    """``plan`` saying that it keeps every gathered token tensor as this rank's piece, gathered again in the backward
    (as Megatron-SP does), to price with price_plan."""
    pieces = Plan.from_json(plan.to_json())
    gathered = [entry for entry in pieces.nodes.values() if "regather" in entry]
    assert gathered and not any(entry["regather"] for entry in gathered), "no gathered tokens kept whole"
    for entry in gathered:
        entry["regather"] = True
    return pieces


def regather_limits(model, args, world: int = 2) -> tuple[float, float]:
    """(bytes per device of the sequence-parallel plan, which keeps every gathered token tensor whole for its
    backward, and of the same plan keeping each as this rank's piece gathered again): under a memory limit between
    the two the solver gathers some again; at the second, about all of them."""
    gm = prepared_graph(model, args, None, fold=True)
    whole = solve_plan(gm, world, PlanOptions(sequence_parallel=True, recompute=False))
    return whole.cost["memory"]["total"], price_plan(gm, regathering_all(whole)).cost["memory"]["total"]


def matches_one_process(model, sharded, shapes, plan=None) -> dict:
    """Outputs for every (batch, sequence) and gradients equal one process's; forward and backward run
    the collectives the plan lists.  Returns the backward's collectives (CommDebugMode, all-reduces as such)."""
    transport = autotp.runtime.transport
    one_shot, transport.ONE_SHOT_BYTES = transport.ONE_SHOT_BYTES, 0  # count all-reduces as such
    try:
        for batch, seq in shapes:
            x = torch.randint(0, 96, (batch, seq))
            with CommDebugMode() as comm:
                out = logits(sharded(x))
            torch.testing.assert_close(out, logits(model(x)), **TOL)
            if plan is not None:
                assert plan_ops(comm_counts(comm)) == plan.collective_counts("forward"), comm_counts(comm)
        x = torch.randint(0, 96, (2, 11))
        loss = logits(sharded(x)).square().mean()
        with CommDebugMode() as comm:  # kept tokens are gathered again once, however many ops kept them
            loss.backward()
        if plan is not None:
            assert plan_ops(comm_counts(comm)) == plan.collective_counts("backward"), comm_counts(comm)
    finally:
        transport.ONE_SHOT_BYTES = one_shot
    logits(model(x)).square().mean().backward()
    grads = autotp.full_state_dict(sharded, grads=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    return comm_counts(comm)
