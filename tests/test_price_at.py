"""PlanOptions.price_at: a plan captured at small example inputs, priced at the shapes a run uses, is the plan of
examples of those shapes; dims the capture fixed, and names that are not inputs, are refused in one line."""

from __future__ import annotations

import pytest
import torch
from transformers import Olmo2ForCausalLM

import autotp
from tests.helpers import configs


def _model():
    with torch.device("meta"):
        return Olmo2ForCausalLM(configs.olmo2(num_hidden_layers=2))


def _ids(batch: int, seq: int) -> torch.Tensor:
    return torch.zeros(batch, seq, dtype=torch.long, device="meta")


def test_a_small_capture_priced_at_a_run_shape_plans_as_that_shape():
    model = _model()
    small = autotp.plan(model, (), {"input_ids": _ids(2, 8)}, world_size=2, training=False)
    priced = autotp.plan(
        model, (), {"input_ids": _ids(2, 8)}, world_size=2, training=False, price_at={"input_ids": (16, 2048)}
    )
    direct = autotp.plan(model, (), {"input_ids": _ids(16, 2048)}, world_size=2, training=False)
    assert priced.nodes == direct.nodes and priced.params == direct.params
    assert priced.cost["seconds"] == pytest.approx(direct.cost["seconds"], rel=1e-9)
    # the run's tokens are priced, not the example's: its KV cache is theirs (16 x 2048 tokens, not 2 x 8)
    assert priced.cost["memory"]["kv_cache"] == small.cost["memory"]["kv_cache"] * (16 * 2048) / (2 * 8)
    assert priced.cost["seconds"] > small.cost["seconds"]


@pytest.mark.parametrize(
    ("price_at", "message"),
    [
        ({"ids": (16, 2048)}, "price_at names 'ids', not a tensor input"),
        ({"input_ids": (16,)}, "has 1 dims, the example input 2"),
        ({"input_ids": (0, 2048)}, "price_at maps input names to shapes of positive sizes"),
    ],
)
def test_a_price_at_that_is_not_the_inputs_is_refused_in_one_line(price_at, message):
    with pytest.raises(ValueError, match=message):
        autotp.plan(_model(), (), {"input_ids": _ids(2, 8)}, world_size=2, price_at=price_at)


def test_a_dim_the_capture_fixed_is_refused():
    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)

        def forward(self, x):
            return self.down(self.up(x).relu())

    with torch.device("meta"):
        model, x = Mlp(), torch.zeros(2, 8)
    with pytest.raises(ValueError, match="sets dim 1 to 16, but the capture fixed it at 8: pass an example input"):
        autotp.plan(model, (), {"x": x}, world_size=2, price_at={"x": (4, 16)})
