"""The suite's shared captures (tests/helpers/shared_capture.py) must serve a capture only for what would capture
alike."""
from __future__ import annotations

import threading

import torch

from autotp.passes.capture import capture
from tests.helpers.models import ParallelBranches
from tests.helpers.shared_capture import copy_of, digest


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
    others.append(digest(changed, x, None))
    assert None not in others and len({same, *others}) == len(others) + 1
    assert digest(_model(lock=threading.Lock()), x, None) is None  # cannot be read: captured as usual


class _Offsets(ParallelBranches):
    def forward(self, x):  # a tensor made in the forward: export lifts it to a constant, a plain attribute
        return super().forward(x) + torch.tensor([0.5] * 16)


def test_a_served_capture_is_a_copy_of_its_own_with_the_same_tensors():
    torch.manual_seed(0)
    model, x = _Offsets(hidden=16), (torch.randn(2, 3, 16),)
    gm = capture(model, x)
    first = copy_of(gm)
    assert first is not None and sorted(first.state_dict()) == sorted(gm.state_dict())
    first.graph.erase_node(next(n for n in first.graph.nodes if n.op == "output"))  # what prepare's passes may do
    second = copy_of(gm)
    assert any(n.op == "output" for n in second.graph.nodes)
    torch.testing.assert_close(second(*x), model(*x))
