"""Rotary embeddings computed with complex numbers (a ``torch.polar`` buffer, ``view_as_complex`` / ``view_as_real``,
a complex product): planned like their real views, split by heads with whole (real, imaginary) pairs, exact at 2, 3
and 4 ranks in training and generation, at Megatron's count."""

from __future__ import annotations

import pytest
import torch

import autotp
from tests.helpers.distributed import AT_THREE_RANKS, run_ranks
from tests.helpers.exact import same_as_model, sums_per_block
from tests.helpers.native_models import VOCAB, complex_rotary_lm, greedy

# world -> (query heads, KV heads, how KV heads are repeated): shared KV heads at 4 ranks, 6 heads at 3
CASES = {2: (4, 2, "expand"), 3: (6, 3, "interleave"), 4: (4, 2, "expand")}


def _complex_rotary(rank: int, world: int) -> None:
    heads, kv, repeat = CASES[world]
    model = complex_rotary_lm(dim=8 * heads, heads=heads, kv_heads=kv, repeat=repeat)
    sharded = autotp.parallelize(model, (torch.randint(0, VOCAB, (2, 8)),))
    plan = sharded.autotp_plan
    assert plan.replicated_ops == [], plan.replicated_ops
    assert plan.params["freqs_cis"] == "R" and sharded.freqs_cis.dtype == torch.complex64  # read by every head
    assert plan.params["layers.0.attention.wq.weight"].startswith("S(0")  # split by heads, q and k not gathered
    assert plan.params["layers.0.attention.wo.weight"].startswith("S(1")
    assert set(sums_per_block(plan).values()) == {2}, plan.collectives  # Megatron: two a block
    same_as_model(model, sharded, lambda batch, seq: (torch.randint(0, VOCAB, (batch, seq)),))
    # generation: greedy, token-exact with the model's own loop
    prompts = torch.randint(0, VOCAB, (3, 4))
    assert torch.equal(autotp.generate(sharded, prompts, max_new_tokens=6), greedy(model, prompts, 6))


@pytest.mark.parametrize("world", AT_THREE_RANKS)
def test_complex_rotary_is_split_by_heads_and_exact(world):
    run_ranks(world, _complex_rotary)


def test_complex_buffers_are_accepted_and_parameters_named():
    model = complex_rotary_lm()
    ids = torch.randint(0, VOCAB, (2, 8))
    plan = autotp.plan(model, (ids,), world_size=2)
    kinds = {entry["op"] for entry in plan.nodes.values()}
    assert {"aten.view_as_complex.default", "aten.view_as_real.default"} <= kinds and plan.replicated_ops == []
    model.layers[0].ffn_norm.weight = torch.nn.Parameter(torch.ones(32, dtype=torch.complex64))
    with pytest.raises(
        TypeError,
        match=r"ffn_norm\.weight has dtype torch\.complex64: complex tensors are sharded "
        r"as buffers",
    ):
        autotp.plan(model, (ids,), world_size=2)


def test_dtype_advice_never_casts_a_complex_buffer():
    """``model.to(torch.bfloat16)`` keeps only the real part of a complex buffer (PyTorch warns, the model runs on,
    wrong): the error for another unsupported dtype must not advise it when the model holds one."""
    model = complex_rotary_lm()
    model.norm.weight = torch.nn.Parameter(model.norm.weight.to(torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(TypeError, match=r"norm\.weight has dtype torch\.float8_e4m3fn") as raised:
        autotp.plan(model, (torch.zeros(2, 8, dtype=torch.long),), world_size=2)
    message = str(raised.value)
    assert "freqs_cis" in message and "drop its imaginary part" in message
    assert "convert the model (model.to" not in message
