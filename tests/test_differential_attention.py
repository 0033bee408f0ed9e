"""DiffLlama (transformers, random weights): differential attention.  The value heads are cut into two halves, each
half's heads repeated over both halves of query heads (``cat(chunk(v, 2, dim=1), -1).repeat(1, 2, 1, 1)`` in
transformers' eager layout, two attentions of the halves in its SDPA one), and output head h is combined with head
h + H/2.  Split evenly, a rank would hold the first or the second half, so every combination would need both:
instead each half is split alike, block by block (S(1|H/2,H/2)), down from the projections' weights; the repeat
of a split dim is such blocks.  Megatron's count, exact in training at 2 ranks, for both attention layouts."""

from __future__ import annotations

import pytest
import torch
from transformers import DiffLlamaForCausalLM

import autotp
from tests.helpers.configs import diffllama
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import same_as_model, sums_per_block

VOCAB, HEADS, HEAD_DIM = 100, 4, 8


def _model(layout: str) -> DiffLlamaForCausalLM:
    torch.manual_seed(0)
    return DiffLlamaForCausalLM(
        diffllama(
            hidden_size=HEADS * HEAD_DIM,
            num_attention_heads=HEADS,
            num_key_value_heads=HEADS,
            attn_implementation=layout,
        )
    ).train()


def _inputs(batch: int, seq: int) -> tuple:
    return (torch.randint(0, VOCAB, (batch, seq)),)


def _run(rank: int, world: int, layout: str) -> None:
    model = _model(layout)
    sharded = autotp.parallelize(model, _inputs(2, 6))
    plan = sharded.autotp_plan
    half = HEADS // 2 * HEAD_DIM
    assert {plan.params[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"} == {f"S(0|{half},{half})"}, (
        plan.params
    )
    assert set(sums_per_block(plan).values()) == {2}, plan.collectives  # Megatron's: one a sublayer
    same_as_model(model, sharded, _inputs)


@pytest.mark.parametrize("layout", ["sdpa", "eager"])
def test_differential_attention_split_by_halves_of_heads_exact(layout):
    run_ranks(2, _run, layout)
