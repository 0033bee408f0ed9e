"""Model code from another library, installed from PyPI (the dev extra), never copied: x-transformers' decoder
(einops rearranges, attention as einsums, rotary computed with autocast off, grouped KV heads) is split by heads
and exact at 2 ranks."""

from __future__ import annotations

import pytest
import torch

import autotp
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import forward_matches, training_matches

x_transformers = pytest.importorskip("x_transformers")

VOCAB, DEPTH = 256, 2


def decoder(kv_heads: int):
    torch.manual_seed(0)
    layers = x_transformers.Decoder(
        dim=64, depth=DEPTH, heads=4, attn_kv_heads=kv_heads, rotary_pos_emb=True, attn_dim_head=16
    )
    return x_transformers.TransformerWrapper(num_tokens=VOCAB, max_seq_len=64, attn_layers=layers).eval()


def _attention_split(plan) -> bool:
    cores = [e for e in plan.nodes.values() if e["op"] == "aten.einsum.default" and ".attend" in e["module"]]
    return bool(cores) and all(e["out"] == "S(1)" for e in cores)


def _x_transformers(rank: int, world: int) -> None:
    for kv_heads in (4, 2):
        model = decoder(kv_heads)
        sharded = autotp.parallelize(model, (torch.randint(0, VOCAB, (2, 16)),))
        plan = sharded.autotp_plan
        assert plan.replicated_ops == [] and _attention_split(plan), plan.nodes
        counts = plan.collective_counts("forward")
        assert counts["all_reduce"] == 2 * DEPTH, counts  # Megatron's: one per attention, one per MLP
        # 4 heads over 2 KV heads as (r kvh): query head i reads KV head i % 2, so each rank needs both KV heads
        assert counts["all_gather"] == 2 + (2 * DEPTH if kv_heads < 4 else 0), counts  # embedding and head
        forward_matches(model, sharded, [(torch.randint(0, VOCAB, (3, 5)),), (torch.randint(0, VOCAB, (1, 1)),)])
        training_matches(model, sharded, [(torch.randint(0, VOCAB, (2, 6)),) for _ in range(2)])


def test_x_transformers_decoder_is_split_by_heads_and_exact():
    run_ranks(2, _x_transformers)
