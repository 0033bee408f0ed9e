"""Activation memory: the tensors autograd keeps for backward, as the planner counts them.

Oracle: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
Table 2, all four rows (bytes per layer, 16-bit activations, 1-byte dropout masks, attention scores materialized).
"""

from __future__ import annotations

import pytest
import torch

from autotp.options import PlanOptions
from autotp.passes.prepared_graph import prepared_graph
from autotp.planning.tensor_plan import price_plan, solve_plan
from tests.helpers import configs
from tests.helpers.sequence_parallel import regathering_all

S, H, HEADS = 2048, 2048, 16


@pytest.fixture(scope="module")
def gpt3_block():
    """A GPT-3 style stack on the meta device (LayerNorm, GELU MLP of 4h, dropout 0.1 everywhere, eager
    attention that materializes the scores), bf16, in training mode as the paper's run: its dropouts drop, and
    the activation model counts their one-byte masks."""
    from transformers import GPT2LMHeadModel

    config = configs.gpt2(
        n_layer=3,
        n_embd=H,
        n_head=HEADS,
        n_positions=S,
        vocab_size=1024,
        activation_function="gelu",
        attn_implementation="eager",
        use_cache=True,
    )
    with torch.device("meta"):
        model = GPT2LMHeadModel(config).to(torch.bfloat16)
    with pytest.warns(UserWarning, match="drops in the sharded model"):
        return prepared_graph(model.train(), (torch.zeros(1, S, dtype=torch.long, device="meta"),), None)


def _per_layer(plan) -> float:
    """Bytes kept for the middle block's tensors (each layer keeps its own input's norm, so any block
    but the first and last holds one layer's worth)."""
    return sum(v for module, v in plan.cost["activations"].items() if module.startswith("transformer.h.1"))


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_activations_match_korthikanti_table_2(gpt3_block, t):
    s, b, h, a = S, 1, H, HEADS
    plan = solve_plan(gpt3_block, t, PlanOptions(memory_limit=float("inf"), sequence_parallel=False))
    paper = s * b * h * (34 + 5 * a * s / h) if t == 1 else s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert _per_layer(plan) == pytest.approx(paper, rel=0.02)
    assert plan.cost["memory"]["activations"] >= 3 * paper  # three layers, plus the embedding and the head
    if t > 1:  # sequence parallelism: the norms, dropouts and residual adds split too
        # with memory to spare the two gathered norm outputs the QKV and first MLP products read (2sbh bytes each)
        # are kept whole; kept as this rank's piece and gathered again (Megatron-SP), the paper's sbh(34/t + ...)
        whole = solve_plan(gpt3_block, t, PlanOptions(memory_limit=float("inf"), sequence_parallel=True))
        assert _per_layer(whole) == pytest.approx(s * b * h * (4 + 30 / t + 5 * a * s / (h * t)), rel=0.02)
        split = price_plan(gpt3_block, regathering_all(whole))
        assert _per_layer(split) == pytest.approx(s * b * h * (34 / t + 5 * a * s / (h * t)), rel=0.02)
        # selective recomputation: the attention core (scores, softmax, dropout) keeps nothing of its own
        again = solve_plan(
            gpt3_block, t, PlanOptions(memory_limit=float("inf"), sequence_parallel=True, recompute="selective")
        )
        assert _per_layer(again) == pytest.approx(s * b * h * (4 + 30 / t), rel=0.02)
        assert _per_layer(price_plan(gpt3_block, regathering_all(again))) == pytest.approx(34 * s * b * h / t, rel=0.02)
        assert "transformer.h.1.attn" in again.cost["recompute"] and not split.cost["recompute"]
