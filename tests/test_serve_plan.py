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
POOL = 0.9 * 80e9  # --memory-fraction 0.9 of an H100


def _arithmetic(config, world: int, context: int, repeat: bool = False) -> dict:
    """From the config alone, bf16, everything split over ``world``: the KV cache a sequence holds on a device
    (K and V by KV heads, every layer), the weights a device holds and the sequences that fit beside them in
    POOL; ``repeat``: each sequence also needs one layer's K and V repeated to the query heads (the decode step's
    temporary, held while one attention runs)."""
    hidden, heads, kv, layers = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.num_hidden_layers,
    )
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    block = hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * config.intermediate_size + 2 * hidden
    weights = 2 * (2 * config.vocab_size * hidden + layers * block + hidden) / world
    cache = 2 * layers * kv * context * head_dim * 2 / world
    per_sequence = cache + (2 * heads * context * head_dim * 2 / world if repeat else 0)
    return {"kv": cache, "weights": weights, "fit": int((POOL - weights) // per_sequence)}


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
    expected = _arithmetic(config, world, CONTEXT, repeat=True)  # 2 blocks: the repeat's share is large
    assert serve.kv_bytes_per_sequence == pytest.approx(expected["kv"], rel=0.05)
    assert serve.sequences_that_fit == pytest.approx(expected["fit"], rel=0.15), (serve.sequences_that_fit, expected)
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


@pytest.mark.slow  # the default tier plans a tiny LLaMA this way (tests/test_cli.py)
def test_a_batch_that_does_not_fit_is_planned_at_the_sequences_that_do():
    """--max-batch beyond the pool: the plan is made for the sequences that fit (as many as the config's arithmetic
    says, within 15%), and says what was asked; 8B's widths, 2 blocks, TP 8."""
    model = _llama70b(EIGHT_B)
    serve = plan_serving(model, world_size=8, context=CONTEXT, max_batch=100_000, topology="dgx-h100")
    expected = _arithmetic(model.config, 8, CONTEXT, repeat=True)
    assert serve.requested == 100_000 and serve.batch == pytest.approx(expected["fit"], rel=0.15), serve.batch
    assert serve.sequences_that_fit >= serve.batch  # the plan of those sequences fits them
    assert serve.kv_bytes_per_sequence == pytest.approx(expected["kv"], rel=0.05)


def test_an_inference_plan_holds_kv_by_kv_heads_and_temporaries_at_their_peak():
    """A forward at inference: its K and V as a cache holds them (by KV heads, every layer), the repeat to the
    query heads a temporary of one layer (the largest, not their sum over layers)."""
    from transformers import LlamaForCausalLM

    import autotp
    from tests.helpers import configs

    config = configs.llama(num_attention_heads=8, num_key_value_heads=2)  # 2 blocks
    with torch.device("meta"):
        model = LlamaForCausalLM(config).eval()
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    memory = autotp.plan(model, (ids,), world_size=2, training=False, fold=False).cost["memory"]
    head_dim = config.hidden_size // config.num_attention_heads
    one_layer_kv = 2 * 2 * 32 * config.num_key_value_heads * head_dim * 4 / 2  # K and V, fp32, over 2 ranks
    assert memory["kv_cache"] == pytest.approx(config.num_hidden_layers * one_layer_kv)
    repeated = one_layer_kv * config.num_attention_heads / config.num_key_value_heads
    assert memory["temporaries"] == pytest.approx(repeated)  # one layer's, not the sum of both


@pytest.mark.slow
@pytest.mark.parametrize("widths, world", [(w, world) for w in ("70b", "8b") for world in (4, 8)])
def test_whole_models_fit_as_the_configs_arithmetic_says(widths, world):
    """LLaMA-3 70B and 8B, every block, context 8192, --max-batch 64: KV a sequence per device within 5% and the
    sequences that fit within 15% of the arithmetic from the config alone (70B at TP 4: 640 MiB a sequence, 54
    fit; issue 54)."""
    layers = {"num_hidden_layers": 80 if widths == "70b" else 32}
    model = _llama70b({**(WIDTHS if widths == "70b" else {}), **layers})
    serve = plan_serving(model, world_size=world, context=8192, max_batch=64, topology="dgx-h100")
    expected = _arithmetic(model.config, world, 8192)
    assert serve.kv_bytes_per_sequence == pytest.approx(expected["kv"], rel=0.05)
    assert serve.sequences_that_fit == pytest.approx(expected["fit"], rel=0.15), (serve.sequences_that_fit, expected)
    assert serve.batch == min(64, serve.sequences_that_fit) or serve.sequences_that_fit >= 64
