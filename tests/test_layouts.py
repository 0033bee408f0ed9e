"""Megatron's count on two more layouts: a fused qkv packed per head ([heads, 3, head dim] rows) with ALiBi slopes
per head, attention computed on heads merged with the batch (BLOOM: baddbmm / bmm on [B*H, ...]), split by heads;
and a norm over all heads' q or k (OLMo2's QK-norm), which all-reduces its per-token statistics instead of gathering
q and k.  Exact at 2, 3 and 4 ranks; the statistics' all-reduces are planned, priced and run as planned (the plan
made on the meta device, applied to the real model)."""

from __future__ import annotations

import functools

import pytest
import torch

import autotp
from tests.helpers import configs
from tests.helpers.distributed import AT_THREE_RANKS, run_ranks
from tests.helpers.exact import same_as_model, sums_per_block


def _bloom(heads: int):
    from transformers import BloomForCausalLM

    config = configs.bloom(hidden_size=8 * heads, n_head=heads)
    config._attn_implementation = "eager"  # alibi.baddbmm(q, k^T) on [B*H, S, d]
    torch.manual_seed(0)
    return BloomForCausalLM(config).eval()


def _olmo2(heads: int, device: str = "cpu"):
    from transformers import Olmo2ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return Olmo2ForCausalLM(
            configs.olmo2(hidden_size=16 * heads, num_attention_heads=heads, num_key_value_heads=heads)
        ).eval()


def _ids(batch: int, seq: int) -> tuple:
    return (torch.randint(0, 96, (batch, seq)),)


def _heads(world: int) -> int:
    return 6 if world == 3 else 4


def _bloom_split_by_heads(rank: int, world: int) -> None:
    model = _bloom(_heads(world))
    sharded = autotp.parallelize(model, _ids(2, 8))
    plan = sharded.autotp_plan
    assert plan.replicated_ops == [], plan.replicated_ops  # baddbmm / bmm on [B*H, ...] no longer gather q, k
    assert plan.params["transformer.h.0.self_attention.query_key_value.weight"] == "S(0)"  # whole heads' rows
    assert set(sums_per_block(plan, blocks=r"\.h\.(\d+)(\.|$)").values()) == {2}, plan.collectives
    same_as_model(model, sharded, _ids)


@pytest.mark.parametrize("world", AT_THREE_RANKS)
def test_alibi_heads_merged_with_the_batch_are_split(world):
    run_ranks(world, _bloom_split_by_heads, captures=functools.partial(_bloom_models, world))


def _bloom_models(world: int) -> list:
    return [(_bloom(_heads(world)), _ids(2, 8))]


def _qk_norm(rank: int, world: int) -> None:
    model = _olmo2(_heads(world))
    # planned at a realistic token count (the choice is a cost decision; at 16 tokens gathering 4 KB is cheaper) on
    # the meta device, where that costs nothing, and applied to the real model at small inputs (its capture on the
    # CPU differs from meta's by two contiguous copies and by the names of ops export dropped)
    meta = _olmo2(_heads(world), "meta")
    plan = autotp.plan(meta, _realistic(), world_size=world)
    for name in ("q_proj", "k_proj", "v_proj"):
        assert plan.params[f"model.layers.0.self_attn.{name}.weight"] == "S(0)", plan.params
    stats = [c for c in plan.collectives if c["phase"] == "forward" and c["module"].endswith(("q_norm", "k_norm"))]
    assert len(stats) == 2 * 2 and all(c["op"] == "all_reduce" and c["bytes"] == 2 * 4096 * 4 for c in stats), stats
    assert all(c["seconds"] > 0 for c in stats)  # priced
    assert set(sums_per_block(plan).values()) == {4}, plan.collectives  # Megatron's two, and q's and k's statistics
    sharded = autotp.parallelize(model, _ids(2, 8), plan=plan)
    same_as_model(model, sharded, _ids)


@pytest.mark.parametrize("world", AT_THREE_RANKS)
def test_qk_norm_sums_statistics_instead_of_gathering(world):
    run_ranks(world, _qk_norm, captures=functools.partial(_qk_norm_models, world))


def _realistic() -> tuple:
    return (torch.zeros(2, 4096, dtype=torch.long, device="meta"),)


def _qk_norm_models(world: int) -> list:
    return [(_olmo2(_heads(world), "meta"), _realistic()), (_olmo2(_heads(world)), _ids(2, 8))]


def test_qkv_packed_per_head_is_split_by_heads():
    """GPT-NeoX's [heads, 3, head dim] rows, sequential residual: whole heads' rows per rank, two all-reduces a block
    (its exactness at 2, 3 and 4 ranks: test_architectures.py)."""
    from transformers import GPTNeoXForCausalLM

    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(configs.gpt_neox(use_parallel_residual=False)).eval()
    for world in (2, 4):
        plan = autotp.plan(model, _ids(2, 8), world_size=world)
        assert plan.replicated_ops == [] and plan.params["gpt_neox.layers.0.attention.query_key_value.weight"] == "S(0)"
        assert set(sums_per_block(plan).values()) == {2}, plan.collectives
