"""Activation memory: the tensors autograd keeps for backward, as the planner counts them.

Oracle: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
Table 2, all four rows (bytes per layer, 16-bit activations, 1-byte dropout masks, attention scores materialized).
"""
from __future__ import annotations

import pytest
import torch

from autotp.api import prepared_graph, solve_plan
from autotp.options import Options

S, H, HEADS = 2048, 2048, 16


@pytest.fixture(scope="module")
def gpt3_block():
    """A GPT-3 style stack on the meta device (LayerNorm, GELU MLP of 4h, dropout 0.1 everywhere, eager
    attention that materializes the scores), bf16, in training mode as the paper's run: its dropouts drop, and
    the activation model counts their one-byte masks."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=3, n_embd=H, n_head=HEADS, n_positions=S, vocab_size=1024,
                        activation_function="gelu", attn_implementation="eager")
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
    plan = solve_plan(gpt3_block, t, Options(memory_limit=float("inf"), sequence_parallel=False))
    paper = s * b * h * (34 + 5 * a * s / h) if t == 1 else s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert _per_layer(plan) == pytest.approx(paper, rel=0.02)
    assert plan.cost["memory"]["activations"] >= 3 * paper  # three layers, plus the embedding and the head
    if t > 1:  # sequence parallelism: the norms, dropouts and residual adds split too
        split = solve_plan(gpt3_block, t, Options(memory_limit=float("inf"), sequence_parallel=True))
        assert _per_layer(split) == pytest.approx(s * b * h * (34 / t + 5 * a * s / (h * t)), rel=0.02)
        # selective recomputation: the attention core (scores, softmax, dropout) keeps nothing of its own
        again = solve_plan(gpt3_block, t, Options(memory_limit=float("inf"), sequence_parallel=True,
                                                   recompute="selective"))
        assert _per_layer(again) == pytest.approx(34 * s * b * h / t, rel=0.02)
        assert "transformer.h.1.attn" in again.cost["recompute"] and not split.cost["recompute"]


def saved_bytes(module: torch.nn.Module, *inputs) -> int:
    """Bytes of the tensors autograd keeps during ``module(*inputs)``, each storage once; parameters,
    buffers and the inputs are not activations.  A sequence-parallel program stores the pieces of
    gathered tensors through its own hooks (autotp.runtime.activations): what those keep is counted."""
    from autotp.runtime import activations
    from autotp.runtime.activations import Recomputed
    held = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers(), *inputs]}
    seen: dict = {}

    def count(stored):
        tensor = stored if isinstance(stored, torch.Tensor) else stored[0][0]  # regather: ([piece, ...], ...)
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in held:
            seen[storage.data_ptr()] = storage.nbytes()
        return stored

    pack = activations._pack
    activations._pack = lambda tensor: count(pack(tensor))
    # a recomputed piece (torch.utils.checkpoint) keeps its inputs, and nothing its ops save
    def count_inputs(mod, args):
        for arg in args:
            if isinstance(arg, torch.Tensor):
                count(arg)

    hooks = [m.register_forward_pre_hook(count_inputs) for m in module.modules() if isinstance(m, Recomputed)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
            out = module(*inputs)
    finally:
        activations._pack = pack
        for hook in hooks:
            hook.remove()
    del out
    return sum(seen.values())
