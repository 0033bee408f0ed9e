"""Checks shared by the end-to-end tests of model styles: a sharded model computes what the model computes, in
the forward and over training steps, running the collectives its plan lists."""

from __future__ import annotations

import re
from collections import Counter

import torch

import autotp
from tests.helpers.distributed import CollectiveCounter, comm_counts, plan_ops, weight_collectives

# the tolerance of every comparison with the unsharded model (float32): the only one, imported by the tests
TOL = {"rtol": 1e-4, "atol": 1e-5}


def sums_per_block(plan, phase: str = "forward", blocks: str = r"layers\.(\d+)(\.|$)") -> Counter:
    """block index -> collectives that sum partial sums (all-reduces, or reduce-scatters where the plan splits
    the residual stream) the plan runs in that block (module paths matched by ``blocks``)."""
    return Counter(
        int(found.group(1))
        for c in plan.collectives
        if c["phase"] == phase and c["op"] in ("all_reduce", "reduce_scatter")
        for found in [re.search(blocks, c["module"])]
        if found
    )


def forward_matches(model, sharded, inputs: list[tuple]) -> None:
    """Outputs equal the model's for each input tuple, running exactly the plan's forward collectives (all-reduces
    counted as such); weights never travel."""
    plan = sharded.autotp_plan
    assert not weight_collectives(sharded), weight_collectives(sharded)
    transport = autotp.runtime.transport
    one_shot, transport.ONE_SHOT_BYTES = transport.ONE_SHOT_BYTES, 0
    try:
        for args in inputs:
            with CollectiveCounter() as comm:
                out = sharded(*args)
            torch.testing.assert_close(logits(out), logits(model(*args)), **TOL)
            assert plan_ops(comm_counts(comm)) == plan.collective_counts("forward"), comm_counts(comm)
    finally:
        transport.ONE_SHOT_BYTES = one_shot


def logits(out) -> torch.Tensor:
    return getattr(out, "logits", out)


def training_matches(model, sharded, inputs: list[tuple], loss=lambda out: logits(out).logsumexp(-1).mean()) -> None:
    """SGD steps on each input tuple leave the sharded weights equal to the model's; the first backward runs
    exactly the plan's backward collectives."""
    plan = sharded.autotp_plan
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (sharded, model))
    transport = autotp.runtime.transport
    one_shot, transport.ONE_SHOT_BYTES = transport.ONE_SHOT_BYTES, 0
    try:
        for step, args in enumerate(inputs):
            for m, o in ((sharded, opt), (model, opt_ref)):
                o.zero_grad()
                value = loss(m(*args))
                with CollectiveCounter() as comm:
                    value.backward()
                if m is sharded and step == 0:
                    assert plan_ops(comm_counts(comm)) == plan.collective_counts("backward"), comm_counts(comm)
                    grads = autotp.full_state_dict(sharded, grads=True)
                o.step()
            if step == 0:
                for name, p in model.named_parameters():
                    torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"grad {n}: {m}")
    finally:
        transport.ONE_SHOT_BYTES = one_shot
    weights = autotp.full_state_dict(sharded)
    for name, p in model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), **TOL, msg=lambda m, n=name: f"{n}: {m}")


def same_as_model(model, sharded, inputs) -> None:
    """The forward at (3, 5) and (1, 1), then two training steps at (2, 6): ``inputs(batch, seq)`` makes the inputs."""
    torch.manual_seed(1)
    forward_matches(model, sharded, [inputs(3, 5), inputs(1, 1)])
    training_matches(model, sharded, [inputs(2, 6) for _ in range(2)])
