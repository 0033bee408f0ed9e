"""Collectives in the form inductor fuses (asynchronous TP): run on copies of the compiled sequence-parallel
programs of a LLaMA and a Mixtral (one rank of 2, a fake process group, NCCL and symmetric memory reported
available), inductor's micro-pipeline TP pass fuses at least as many all-gather -> matmul and matmul ->
reduce-scatter pairs in autotp's program as in DTensor's hand plan of the same model, forward and backward;
``async_tp=True`` turns the pass on."""

from __future__ import annotations

import pytest
import torch

import autotp
from tests.helpers import configs
from tests.helpers.async_tp import fused_pairs, hand_plan, in_fake_world
from tests.helpers.models import llama_with

VOCAB = 1024  # the head column-parallel, as the hand plan has it
PLANNED_AT = (64, 64)  # tokens enough that bytes decide: the residual stream split by tokens


def _llama():
    return llama_with(heads=8, kv=4, head_dim=16, vocab=VOCAB, layers=1)


def _mixtral():
    from transformers import MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(configs.mixtral(num_hidden_layers=1, vocab_size=VOCAB, hidden_size=128)).eval()


def _both(build) -> dict:
    """{"autotp": ..., "hand": ...}: the pairs fused in each program's compiled training step."""
    from torch.distributed.device_mesh import init_device_mesh

    x = torch.randint(0, VOCAB, (2, 16))
    sharded = autotp.parallelize(build(), (torch.randint(0, VOCAB, PLANNED_AT),), sequence_parallel=True, async_tp=True)
    assert torch._inductor.config._micro_pipeline_tp
    torch._inductor.config._micro_pipeline_tp = False  # the counting pass runs it on copies
    hand = hand_plan(build(), init_device_mesh("cpu", (2,)))
    return {"autotp": fused_pairs(sharded, x), "hand": fused_pairs(hand, x)}


@pytest.mark.parametrize("build", [_llama, pytest.param(_mixtral, marks=pytest.mark.slow)])
def test_inductor_fuses_at_least_the_hand_plans_pairs(build):
    found = in_fake_world(2, _both, build)
    print(found)
    for phase in ("forward", "backward"):
        for pair, count in found["hand"][phase].items():
            assert found["autotp"][phase][pair] >= count, (phase, pair, found)
    assert found["autotp"]["forward"]["all_gather_matmul"] and found["autotp"]["forward"]["matmul_reduce_scatter"]
