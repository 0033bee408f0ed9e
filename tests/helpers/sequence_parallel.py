"""Sequence-parallel checks shared by tests/test_sequence_parallel.py and tests/test_recompute.py."""

from __future__ import annotations

import torch
from torch.distributed.tensor.debug import CommDebugMode

import autotp
from tests.helpers.distributed import comm_counts, plan_ops
from tests.helpers.exact import TOL
from tests.helpers.models import logits

# priced at 4096 tokens: bytes decide (at a few hundred tokens of these tiny models latency does, and a
# one-shot all-reduce beats a reduce-scatter)
EXAMPLE = (64, 64)


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
