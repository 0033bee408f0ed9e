"""Serving-aware plans (issue 35): a decode step priced with its KV cache at a context length, the prefill with
the same weights.  LLaMA-3 70B's widths (2 of its 80 blocks: every figure below is per block or per sequence) at
TP 4 on dgx-h100, the meta device, no ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autotp.options import PlanOptions
from autotp.passes.prepared_graph import prepared_graph
from autotp.serving.serve_plan import decode_program, fastest_tp_within, plan_serving
from autotp.tools.hand_plans import hand_plans, solve_hand_plan

ROOT = Path(__file__).resolve().parents[1]
WIDTHS = {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "num_hidden_layers": 2,
}
CONTEXT = 4096


def _llama70b(widths: dict = WIDTHS):
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(ROOT / "docs/figures/llama-3-8b.json", **widths)
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(torch.bfloat16)


EIGHT_B = {"num_hidden_layers": 2}  # LLaMA-3 8B's widths, 2 blocks


@pytest.mark.parametrize(
    "widths, world, batch",
    [
        (WIDTHS, 4, 8),
        pytest.param(WIDTHS, 4, 64, marks=pytest.mark.slow),
        *(
            pytest.param(w, world, b, marks=pytest.mark.slow)
            for w, world in ((WIDTHS, 8), (EIGHT_B, 4), (EIGHT_B, 8))
            for b in (8, 64)
        ),
    ],
)
def test_a_decode_step_splits_the_heads_and_its_cache_and_beats_the_hand_plans(widths, world, batch):
    """70B's widths at TP 4 (default tier; at TP 8 and 8B's widths at TP 4 and 8 in the slow tier)."""
    model = _llama70b(widths)
    serve = plan_serving(model, world_size=world, context=CONTEXT, max_batch=batch, topology="dgx-h100")
    blocks, config = model.config.num_hidden_layers, model.config
    heads = {k: v for k, v in serve.decode.params.items() if ".layers.0.self_attn." in k and k.endswith("weight")}
    assert set(heads.values()) == {"S(0)", "S(1)"} and heads["model.model.layers.0.self_attn.o_proj.weight"] == "S(1)"
    # Megatron's count: two all-reduces a block; outside the blocks, the embedding's and the logits' collectives
    in_blocks = [c["op"] for c in serve.decode.collectives if ".layers." in c["module"]]
    assert sorted(in_blocks) == ["all_reduce"] * 2 * blocks, serve.decode.collectives
    assert sum(serve.decode.collective_counts("forward").values()) <= 2 * blocks + 2
    head_dim = config.hidden_size // config.num_attention_heads
    whole = 2 * blocks * config.num_key_value_heads * CONTEXT * head_dim * 2  # K and V, bf16, one sequence
    assert serve.kv_bytes_per_sequence == pytest.approx(whole / world, rel=1e-6)  # 8 KV heads over the ranks
    assert serve.decode_seconds >= serve.bandwidth_bound_seconds  # never faster than reading weights and cache
    assert serve.tokens_per_second == pytest.approx(batch / serve.decode_seconds)
    beside = serve.decode.cost["memory"]["params"]
    assert beside + serve.sequences_that_fit * serve.kv_bytes_per_sequence <= 0.9 * serve.device_bytes
    assert beside + (serve.sequences_that_fit + 1) * serve.kv_bytes_per_sequence > 0.9 * serve.device_bytes - 1e6
    wrapper, gm, step = decode_program(_llama70b(widths), CONTEXT, batch)
    options = PlanOptions(topology="dgx-h100", training=False, price_at=step)
    for name, hand in hand_plans(wrapper.model, ("hf", "megatron"), prefix="model.").items():
        theirs = solve_hand_plan(wrapper, gm, hand, world, options)
        assert serve.decode_seconds <= theirs.cost["seconds"] * (1 + 1e-9), (
            name,
            serve.decode_seconds,
            theirs.cost["seconds"],
        )


@pytest.mark.slow
def test_the_prefill_with_the_decode_weights_beats_the_hand_plans():
    model = _llama70b()
    serve = plan_serving(model, world_size=4, context=CONTEXT, max_batch=8, topology="dgx-h100", prefill_tokens=2048)
    forward = prepared_graph(model, (torch.zeros(2, 16, dtype=torch.long, device="meta"),), None, fold=True)
    options = PlanOptions(topology="dgx-h100", training=False, price_at={"input_ids": (1, 2048)})
    for name, hand in hand_plans(model, ("hf", "megatron", "megatron-sp")).items():
        theirs = solve_hand_plan(model, forward, hand, 4, options)
        assert serve.prefill.cost["seconds"] <= theirs.cost["seconds"] * (1 + 1e-9), name
    assert serve.prefill_seconds_per_1000 == pytest.approx(serve.prefill.cost["seconds"] * 1000 / 2048)


@pytest.mark.slow
def test_the_smallest_tp_size_that_meets_a_decode_target():
    """The TP sizes are tried smallest first; the first whose decode step meets the target is named."""
    plans = {
        size: plan_serving(_llama70b(), world_size=size, context=CONTEXT, max_batch=8, topology="dgx-h100")
        for size in (1, 2)
    }
    target = (plans[1].decode_seconds + plans[2].decode_seconds) / 2 * 1e3
    assert plans[2].decode_seconds < plans[1].decode_seconds
    size, tried = fastest_tp_within(
        _llama70b, decode_ms=target, sizes=(1, 2, 4), context=CONTEXT, max_batch=8, topology="dgx-h100"
    )
    assert size == 2 and sorted(tried) == [1, 2]
    assert (
        fastest_tp_within(_llama70b, decode_ms=1e-6, sizes=(1,), context=CONTEXT, max_batch=8, topology="dgx-h100")[0]
        is None
    )


@pytest.mark.slow
@pytest.mark.parametrize("batch", [8, 64])
def test_a_mixtral_decode_step_beats_transformers_expert_plans(batch):
    """Mixtral-8x7B's shape (2 blocks) at TP 4: the decode step against its tp_plan (experts split) and its
    ep_plan (whole experts, all-to-all), the cache split by KV heads."""
    from transformers import MixtralForCausalLM

    from tests.helpers import configs

    def mixtral():
        with torch.device("meta"):
            return MixtralForCausalLM(configs.mixtral_8x7b(num_hidden_layers=2)).to(torch.bfloat16)

    serve = plan_serving(mixtral(), world_size=4, context=CONTEXT, max_batch=batch, topology="dgx-h100")
    config = configs.mixtral_8x7b()
    whole = 2 * 2 * config.num_key_value_heads * CONTEXT * (config.hidden_size // config.num_attention_heads) * 2
    assert serve.kv_bytes_per_sequence == pytest.approx(whole / 4, rel=1e-6)
    wrapper, gm, step = decode_program(mixtral(), CONTEXT, batch)
    options = PlanOptions(topology="dgx-h100", training=False, price_at=step)
    hands = hand_plans(wrapper.model, ("hf", "hf-ep"), prefix="model.")
    assert sorted(hands) == ["hf", "hf-ep"]
    for name, hand in hands.items():
        theirs = solve_hand_plan(wrapper, gm, hand, 4, options)
        assert theirs is not None and serve.decode_seconds <= theirs.cost["seconds"] * (1 + 1e-9), name
