"""Training a sharded program compiled as one graph (``torch.compile(fullgraph=True)``, inductor on the CPU):
outputs and gradients equal one process's at every step (tests/test_compiled.py,
tests/test_compiled_experts.py)."""

from __future__ import annotations

import torch

import autotp
from tests.helpers.exact import TOL, logits

STEPS = 3


def compiled_training_matches(
    model, sharded, inputs, run=None, loss=lambda out: logits(out).square().mean(), backend="inductor"
):
    """``STEPS`` SGD steps of ``torch.compile(run or sharded, fullgraph=True, backend=backend)`` and of ``model``
    on ``inputs()`` (a new batch of one shape each step): outputs and every gradient equal at each step."""
    compiled = torch.compile(run or sharded, fullgraph=True, backend=backend)
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (sharded, model))
    for step in range(STEPS):
        args = inputs()
        out, ref = logits(compiled(*args)), logits(model(*args))
        torch.testing.assert_close(out, ref, **TOL, msg=lambda m, s=step: f"step {s} output: {m}")
        loss(out).backward()
        loss(ref).backward()
        grads = autotp.full_state_dict(sharded, grads=True)
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name, s=step: f"step {s} {n}: {m}")
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
