"""One price for every plan (issue 35): the solver's plan and hand-written ones (transformers' tp_plan, Megatron's
with and without sequence parallelism, torchtitan's DTensor plan; module patterns in autotp/tools/hand_plans.json)
as complete assignments of one capture, each priced by ``price_plan``.  The solver's plan priced so equals its
objective, and is no dearer than any hand plan at the shapes users run.  Meta device, no ranks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from autotp.options import PlanOptions
from autotp.passes.prepared_graph import prepared_graph
from autotp.planning.tensor_plan import price_plan, solve_plan
from autotp.tools.hand_plans import hand_plans, solve_hand_plan
from tests.helpers.sequence_parallel import regathering_all

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "prefill 1x2048": ((1, 2048), False),
    "prefill 8x128": ((8, 128), False),
    "training 1x4096": ((1, 4096), True),
}


def _llama(config: str, **changes):
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(ROOT / config, **changes)
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(torch.bfloat16)


def _captured(model) -> torch.fx.GraphModule:
    return prepared_graph(model, (torch.zeros(2, 16, dtype=torch.long, device="meta"),), None, fold=True)


@pytest.fixture(scope="module")
def llama_8b() -> tuple:
    """LLaMA-3 8B on the meta device and its folded capture, shared by this file's default-tier tests."""
    model = _llama("docs/figures/llama-3-8b.json")
    return model, _captured(model)


def _priced_against_hand_plans(
    model, world: int, shapes: dict, names=("hf", "megatron", "megatron-sp", "dtensor"), gm=None
) -> None:  # "dtensor": megatron-sp's styles, its gathered tokens saved whole (autotp's plan chooses, per tensor)
    gm = gm if gm is not None else _captured(model)
    hands = hand_plans(model, names)
    assert sorted(hands) == sorted(names), sorted(hands)
    for label, (shape, training) in shapes.items():
        # the fastest plans, fitting or not (hand plans are priced as they stand; 70B's training needs more ranks)
        options = PlanOptions(
            topology="dgx-h100", training=training, price_at={"input_ids": shape}, memory_limit=float("inf")
        )
        ours = solve_plan(gm, world, options, price_experts=True)  # as autotp.plan solves
        again = price_plan(gm, ours, options)
        assert again.cost["seconds"] == pytest.approx(ours.cost["seconds"], rel=1e-3), label
        for name, hand in hands.items():
            theirs = solve_hand_plan(model, gm, hand, world, options)
            assert theirs is not None, (label, name)
            assert ours.cost["seconds"] <= theirs.cost["seconds"] * (1 + 1e-9), (
                label,
                name,
                ours.cost["seconds"],
                theirs.cost["seconds"],
                ours.collective_counts("forward"),
                theirs.collective_counts("forward"),
            )


def test_llama3_8b_at_tp4_is_no_dearer_than_any_hand_plan(llama_8b):
    model, gm = llama_8b
    _priced_against_hand_plans(model, 4, SHAPES, gm=gm)


def test_gathered_tokens_are_kept_whole_unless_memory_binds(llama_8b):
    """Sequence parallelism's gathered tokens (LLaMA-3 8B at TP 4, training 1x4096): with memory to spare the plan
    keeps each whole for its backward (DTensor's way, no all-gather again); the same plan saying that it keeps
    every one as this rank's piece (Megatron-SP's way) is priced with the all-gathers again and less memory;
    under a limit between the two the plan gathers some again, and lists and prices each such all-gather."""
    _, gm = llama_8b
    options = PlanOptions(
        topology="dgx-h100", training=True, price_at={"input_ids": (1, 4096)}, sequence_parallel=True, recompute=False
    )
    free = solve_plan(gm, 4, replace(options, memory_limit=float("inf")))
    kept = {name: entry["regather"] for name, entry in free.nodes.items() if "regather" in entry}
    assert kept and not any(kept.values()) and not free.cost["regathers"]
    assert not any(c.get("regather") for c in free.collectives)
    every = price_plan(gm, regathering_all(free), options)
    assert {r["tensor"] for r in every.cost["regathers"]} == set(kept)
    assert every.cost["memory"]["total"] < free.cost["memory"]["total"]
    assert every.cost["seconds"] > free.cost["seconds"]
    limit = (free.cost["memory"]["total"] + every.cost["memory"]["total"]) / 2
    tight = solve_plan(gm, 4, replace(options, memory_limit=limit))
    assert tight.cost["memory"]["total"] <= limit < free.cost["memory"]["total"]
    again = {r["tensor"] for r in tight.cost["regathers"]}
    assert again and again == {name for name, entry in tight.nodes.items() if entry.get("regather")}
    assert again == {c["tensor"] for c in tight.collectives if c.get("regather")}
    assert tight.cost["seconds"] > free.cost["seconds"]


def test_a_hand_plan_runs_its_own_collectives():
    """transformers' plan for LLaMA runs two all-reduces a block and the vocabulary-parallel embedding's, and
    gathers the logits (Megatron's count); with sequence parallelism each all-reduce is a reduce-scatter and an
    all-gather.  Inference: no backward collective listed."""
    model = _llama("docs/figures/llama-3-8b.json", num_hidden_layers=4)
    gm = _captured(model)
    options = PlanOptions(topology="dgx-h100", training=False, price_at={"input_ids": (1, 2048)})
    hands = hand_plans(model)
    plain = solve_hand_plan(model, gm, hands["megatron"], 4, options)
    assert dict(plain.collective_counts("forward")) == {"all_reduce": 2 * 4 + 1, "all_gather": 1}
    assert not plain.collective_counts("backward")
    split = solve_hand_plan(model, gm, hands["megatron-sp"], 4, options)
    assert dict(split.collective_counts("forward")) == {"reduce_scatter": 2 * 4 + 1, "all_gather": 2 * 4 + 2}
    training = replace(options, training=True, price_at={"input_ids": (1, 4096)})
    plain, split = (solve_hand_plan(model, gm, hands[name], 4, training) for name in ("megatron", "megatron-sp"))
    # Megatron fuses QKV and gate-up: one sum of the input's gradient a sublayer (Shoeybi et al. 2019, figure 3:
    # g's conjugate f), and the head's input gradient: 2 a block and 1 (Korthikanti et al. 2022, section 4.2.2:
    # with sequence parallelism each is a reduce-scatter)
    assert dict(plain.collective_counts("backward")) == {"all_reduce": 2 * 4 + 1}, plain.collective_counts("backward")
    assert split.collective_counts("backward")["reduce_scatter"] == 2 * 4 + 1, split.collective_counts("backward")


LLAMA_70B = {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64, "num_hidden_layers": 80}


@pytest.mark.slow
@pytest.mark.parametrize("shape, world", [("8b", 8), ("70b", 4), ("70b", 8)])
def test_llama3_is_no_dearer_than_any_hand_plan_at_tp4_and_8(shape, world):
    changes = LLAMA_70B if shape == "70b" else {}
    _priced_against_hand_plans(_llama("docs/figures/llama-3-8b.json", **changes), world, SHAPES)


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 8])
def test_mixtral_is_no_dearer_than_transformers_expert_plans(world):
    """Mixtral-8x7B's shape (2 of its blocks): transformers' tp_plan (every expert split) and its ep_plan (whole
    experts, rows dispatched by all-to-all) against autotp's plan, which chooses its own expert strategy."""
    from transformers import MixtralForCausalLM

    from tests.helpers import configs

    with torch.device("meta"):
        model = MixtralForCausalLM(configs.mixtral_8x7b(num_hidden_layers=2)).to(torch.bfloat16)
    _priced_against_hand_plans(model, world, SHAPES, names=("hf", "hf-ep"))


@pytest.mark.slow
def test_qwen_moe_is_no_dearer_than_transformers_expert_plans():
    """A Qwen2-MoE config (60 experts of 1408 and a shared expert, 2 blocks) at TP 4."""
    from transformers import Qwen2MoeForCausalLM

    from tests.helpers import configs

    config = configs.qwen2_moe(
        hidden_size=2048,
        intermediate_size=5632,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        num_experts=60,
        num_experts_per_tok=4,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=151936,
        max_position_embeddings=8192,
    )
    with torch.device("meta"):
        model = Qwen2MoeForCausalLM(config).to(torch.bfloat16)
    names = tuple(hand_plans(model, ("hf", "hf-ep")))
    assert "hf" in names
    _priced_against_hand_plans(model, 4, SHAPES, names=names)
