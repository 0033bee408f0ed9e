"""Activation memory: the tensors autograd keeps for backward, as the planner counts them.

Oracle: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
Table 2 (bytes per layer, 16-bit activations, 1-byte dropout masks, attention scores materialized).
"""
from __future__ import annotations

import pytest
import torch

from autotp.api import _choice, _graph, _solve
from autotp.passes.capture import fingerprint, module_path
from autotp.passes.solve import Sizes, activation_bytes
from autotp.passes.strategies import needs_grad

S, H, HEADS = 1024, 1024, 16


@pytest.fixture(scope="module")
def gpt3_block():
    """A GPT-3 style stack on the meta device (LayerNorm, GELU MLP of 4h, dropout 0.1 everywhere,
    eager attention that materializes the scores), bf16.  autotp captures dropout in eval mode (its
    sharded models never drop); the paper's training run does, so the captured dropouts are switched
    back to training, which is what the activation model must then count."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=3, n_embd=H, n_head=HEADS, n_positions=S, vocab_size=1024,
                        activation_function="gelu", attn_implementation="eager")
    with torch.device("meta"):
        model = GPT2LMHeadModel(config).to(torch.bfloat16)
    gm = _graph(model.eval(), (torch.zeros(1, S, dtype=torch.long, device="meta"),), None)
    for node in gm.graph.nodes:
        if node.target == torch.ops.aten.dropout.default:
            node.args = (node.args[0], 0.1, True)
    return gm


def _per_layer(gm, plan, world: int) -> float:
    """Bytes kept for the middle block's tensors (each layer keeps its own input's norm, so any block
    but the first and last holds one layer's worth)."""
    held = activation_bytes(_choice(gm, plan, fingerprint(gm), world), Sizes(), world, needs_grad(gm))
    return sum(v for node, v in held.items() if (module_path(node) or "").startswith("transformer.h.1"))


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_tensor_parallel_activations_match_korthikanti_table_2(gpt3_block, t):
    s, b, h, a = S, 1, H, HEADS
    plan = _solve(gpt3_block, t, None, memory_limit=float("inf"))
    paper = s * b * h * (34 + 5 * a * s / h) if t == 1 else s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert _per_layer(gpt3_block, plan, t) == pytest.approx(paper, rel=0.05)
    assert plan.cost["memory"]["activations"] >= 3 * paper  # three layers, plus the embedding and the head


def saved_bytes(module: torch.nn.Module, *inputs) -> int:
    """Bytes of the tensors autograd keeps during ``module(*inputs)``, each storage once; parameters,
    buffers and the inputs are not activations."""
    held = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers(), *inputs]}
    seen: dict = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in held:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = module(*inputs)
    del out
    return sum(seen.values())
