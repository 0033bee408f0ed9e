"""Model code from another library, installed from PyPI (the dev extra), never copied: x-transformers' decoder
(einops rearranges, attention as einsums, rotary computed with autocast off, grouped KV heads repeated tiled, a GLU
feed-forward) is split by heads at Megatron's count and exact at 2 ranks."""

from __future__ import annotations

from collections import Counter

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
        dim=64, depth=DEPTH, heads=8, attn_kv_heads=kv_heads, rotary_pos_emb=True, attn_dim_head=8, ff_glu=True
    )
    return x_transformers.TransformerWrapper(num_tokens=VOCAB, max_seq_len=64, attn_layers=layers).eval()


def _attention_split(plan) -> bool:
    cores = [e for e in plan.nodes.values() if e["op"] == "aten.einsum.default" and ".attend" in e["module"]]
    return bool(cores) and all(e["out"].startswith("S(1") for e in cores)  # heads, or blocks of heads


def _block_collectives(plan, phase: str) -> Counter:
    return Counter(c["op"] for c in plan.collectives if c["phase"] == phase and c["module"].startswith("attn_layers"))


def _x_transformers(rank: int, world: int, kv_counts: tuple) -> None:
    for kv_heads in kv_counts:
        model = decoder(kv_heads)
        sharded = autotp.parallelize(model, (torch.randint(0, VOCAB, (2, 16)),))
        plan = sharded.autotp_plan
        assert plan.replicated_ops == [] and _attention_split(plan), plan.nodes
        # Megatron's: one all-reduce per attention, one per MLP, nothing else in the blocks (the embedding's and the
        # head's collectives are the vocabulary's)
        assert _block_collectives(plan, "forward") == {"all_reduce": 2 * DEPTH}, plan.collectives
        backward = _block_collectives(plan, "backward")
        assert set(backward) == {"all_reduce"}, plan.collectives
        to_k = {plan.nodes[n]["out"] for n, e in plan.nodes.items() if e["module"].endswith("to_k")}
        if world <= kv_heads:  # 8 heads over 2 KV heads tiled (r kvh): query head i reads KV head i % 2; rank r's
            # query heads 2r, 2r + 2, ... (blocks of 2 split alike) read only its KV head r, its own to_k rows
            assert to_k == {"S(2)"} and backward["all_reduce"] == 2 * DEPTH + 1, (to_k, plan.collectives)
        else:  # each rank's 2 query heads read both KV heads: to_k held whole, its gradient summed
            assert to_k == {"S(2/1)"} and backward["all_reduce"] == 4 * DEPTH + 1, (to_k, plan.collectives)
        forward_matches(model, sharded, [(torch.randint(0, VOCAB, (3, 5)),), (torch.randint(0, VOCAB, (1, 1)),)])
        training_matches(model, sharded, [(torch.randint(0, VOCAB, (2, 6)),) for _ in range(2)])


def test_x_transformers_decoder_is_split_by_heads_and_exact():
    run_ranks(2, _x_transformers, (8, 2))


@pytest.mark.slow
def test_x_transformers_decoder_with_fewer_kv_heads_than_ranks():
    run_ranks(4, _x_transformers, (2,))
