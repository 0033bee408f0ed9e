"""The suite's shared captures (tests/shared_capture.py) must serve a capture only for what would capture alike."""
from __future__ import annotations

import torch
from shared_capture import digest, shared_capture

from models import ParallelBranches


def _model(**change) -> torch.nn.Module:
    torch.manual_seed(0)
    model = ParallelBranches(hidden=16)
    for name, value in change.items():
        setattr(model, name, value)
    return model


def test_only_identical_models_and_inputs_share_a_capture():
    x = (torch.randn(2, 3, 16),)
    same = digest(_model(), x, None)
    assert same is not None and digest(_model(), (torch.randn(2, 3, 16),), {}) == same  # input values do not count
    others = [digest(_model(), (torch.randn(2, 3, 16, dtype=torch.float64),), None),
              digest(_model(), (torch.randn(2, 3, 16), torch.randn(1)), None),
              digest(_model(), (), {"x": x[0]}),
              digest(_model(scale=2.0), x, None),  # a plain attribute the forward could read
              digest(_model().train(False), x, None)]
    changed = _model()
    with torch.no_grad():
        changed.ln.weight[3] += 1
    others += [digest(changed, x, None), digest(_model(lock=__import__("threading").Lock()), x, None)]
    assert None not in others[:-1] and len({same, *others[:-1]}) == len(others) and others[-1] is None


def test_each_served_capture_is_a_copy_of_its_own():
    model, x = _model(), (torch.randn(2, 3, 16),)
    first = shared_capture(model, x)
    first.graph.erase_node(next(n for n in first.graph.nodes if n.op == "output"))  # what prepare's passes may do
    second = shared_capture(model, x)
    assert any(n.op == "output" for n in second.graph.nodes)
    torch.testing.assert_close(second(*x), model(*x))
