"""Mixture-of-experts: experts are computed where they are stored (issue 17).

Mixtral and Qwen3-MoE (3-D expert weights, grouped matmuls) and a hand-written MoE (examples/moe.py: index +
bmm, interleaved gate/up columns with biases) split each expert Megatron-style: gate/up by output rows, down
by input columns, router replicated, one forward all-reduce per MoE layer; no weight is ever gathered."""

from __future__ import annotations

import functools

import pytest
import torch

import autotp
from examples import moe
from tests.helpers import configs
from tests.helpers.distributed import run_ranks
from tests.helpers.moe import (
    expert_params,
    mixtral,
    pretrained,
    qwen3_moe,
    runs_the_plan,
    same_as_unsharded,
    six_experts,
    six_experts_models,
    with_default_inputs,
)

MODELS = {"mixtral": mixtral, "qwen3-moe": qwen3_moe}  # grouped matmuls (transformers' default experts)


def _hf_models() -> list:
    return with_default_inputs([build() for build in MODELS.values()])


def _hf_exact(rank: int, world: int) -> None:
    for name, build in MODELS.items():
        model = build()
        sharded = autotp.parallelize(model)
        plan = sharded.autotp_plan
        local = dict(sharded.named_parameters())
        for param in expert_params(model):  # every expert kept on every rank, each split Megatron-style
            assert plan.params[param] in ("S(1|48,48)", "S(1|32,32)", "S(2)"), (name, param, plan.params[param])
            assert local[param].numel() * world == model.get_parameter(param).numel(), param
        layers = model.config.num_hidden_layers
        # Megatron's count: one all-reduce for attention and one for the MoE layer, per block (+ the head)
        assert plan.collective_counts("forward")["all_reduce"] <= 2 * layers + 1, (name, plan.collectives)
        routed = 2 * 2 * 8 * 32 * 4  # what the MoE layer's activations need: top-2 copies of 2 x 8 tokens x 32, fp32
        for layer in range(layers):
            moved = sum(
                c["bytes"]
                for c in plan.collectives
                if c["phase"] == "forward" and c["module"].startswith(f"model.layers.{layer}.mlp")
            )
            assert 0 < moved <= routed, (name, layer, plan.collectives)
        runs_the_plan(sharded, plan, torch.randint(0, 96, (2, 5)))
        same_as_unsharded(model, sharded, lambda b, s: torch.randint(0, 96, (b, s)))
        if name == "mixtral":  # greedy decoding with a sharded KV cache, token for token
            ids = torch.randint(3, 96, (2, 5))
            mask = torch.ones_like(ids)
            mask[1, :2] = 0  # left padding
            ids = ids.masked_fill(mask == 0, 0)
            got = autotp.generate(sharded, ids, mask, max_new_tokens=6, pad_token_id=0)
            want = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
            assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_hf_moe_is_exact_with_expert_tensor_parallelism(world):
    """Mixtral and Qwen3-MoE at 2 and 4 ranks; Mixtral's greedy generation equals transformers'."""
    run_ranks(world, _hf_exact, captures=_hf_models)


def _example_exact(rank: int, world: int) -> None:
    """Gate and up columns interleaved, biases on every expert projection (plain gate|up: Mixtral above)."""
    model, args = six_experts()
    sharded = autotp.parallelize(model, args)
    plan = sharded.autotp_plan
    full, local = dict(model.named_parameters()), dict(sharded.named_parameters())
    for name in expert_params(model):  # each rank holds 1/N of every expert's weights
        assert local[name].numel() * world == full[name].numel(), (name, plan.params[name])
    # every rank holds whole (gate, up) column pairs, and their biases
    assert plan.params["0.gate_up"] == plan.params["0.gate_up_bias"] == "S(1)", plan.params
    assert plan.collective_counts("forward") == {"all_reduce": 2}, plan.collectives  # one per MoE layer
    runs_the_plan(sharded, plan, torch.randn(2, 5, 32))
    same_as_unsharded(model, sharded, lambda b, s: torch.randn(b, s, 32))


def test_hand_written_moe_with_six_experts_on_four_ranks():
    run_ranks(4, _example_exact, captures=six_experts_models)


def qwen2_moe(layers: int = 2):
    """Routed experts beside an always-on shared expert (and its sigmoid gate), as Qwen2-MoE and DeepSeek do."""
    from transformers import Qwen2MoeForCausalLM

    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(configs.qwen2_moe(num_hidden_layers=layers)).eval()


def _listed_experts() -> tuple:
    torch.manual_seed(0)
    model, args = moe.build(experts=4, modules=True)
    return model.eval(), args


def _shared_and_listed_models() -> list:
    return [*with_default_inputs([qwen2_moe()]), _listed_experts()]


def _shared_and_listed_experts_exact(rank: int, world: int) -> None:
    """Shared experts split like any MLP, and experts kept as a list of modules: each rank holds 1/N of every
    expert's weights, outputs and gradients are exact, CommDebugMode counts what the plan says."""
    for name in ("qwen2-moe", "modules"):
        if name == "qwen2-moe":
            model, inputs = qwen2_moe(), (lambda b, s: torch.randint(0, 96, (b, s)))
            x = torch.randint(0, 96, (2, 5))
            sharded = autotp.parallelize(model)
            blocks, experts = (
                model.config.num_hidden_layers,
                [*expert_params(model), *(n for n, p in model.named_parameters() if ".shared_expert." in n)],
            )
        else:
            model, args = _listed_experts()
            inputs, x = (lambda b, s: torch.randn(b, s, 32)), torch.randn(2, 5, 32)
            sharded = autotp.parallelize(model, args)
            blocks, experts = 2, [n for n, _ in model.named_parameters() if ".experts." in n]
        plan = sharded.autotp_plan
        local = dict(sharded.named_parameters())
        for param in experts:
            assert local[param].numel() * world == model.get_parameter(param).numel(), (name, param, plan.params[param])
        if name == "qwen2-moe":  # Megatron's count a block: attention's all-reduce, the routed experts' and the
            # shared expert's (its RowParallelLinear reduces on its own); at most two more for the whole model
            forward = plan.collective_counts("forward")
            assert sum(forward.values()) <= 3 * blocks + 2, (name, plan.collectives)
        runs_the_plan(sharded, plan, x)
        same_as_unsharded(model, sharded, inputs)


def test_shared_experts_and_expert_modules_are_split_like_mlps():
    run_ranks(2, _shared_and_listed_experts_exact, captures=_shared_and_listed_models)


def test_interleaved_columns_split_only_in_whole_pairs():
    """Gate in even, up in odd columns: 2 x 6 columns on 4 ranks would cut pairs (3 columns each), so the
    strided slices read them whole; 2 x 48 on 4 (24 each) keeps pairs and says how each expert is split."""
    for ffn, split in ((6, False), (48, True)):
        model, args = moe.build(blocks=1, ffn=ffn, interleaved=True, bias=True)
        plan = autotp.plan(model, args, world_size=4, experts="tensor")
        strided = [n for n in plan.nodes.values() if n["op"] == "aten.slice.Tensor"]
        assert len(strided) == 2 and all(n["in"][0] == ("S(1)" if split else "R") for n in strided), strided
        if split:
            assert plan.styles["0.gate_up"] == "expert FFN column split", plan.styles
            assert plan.styles["0.down"] == "expert FFN row split", plan.styles


def test_batched_experts_are_split_alike():
    """transformers' other experts implementation, w[expert_ids] then bmm: the same Megatron layout."""
    model = mixtral(layers=1, implementation="batched_mm")
    plan = autotp.plan(model, world_size=2)
    assert {plan.params[p] for p in expert_params(model)} == {"S(1|48,48)", "S(2)"}, plan.params
    assert plan.collective_counts("forward")["all_reduce"] <= 2 * 1 + 1, plan.collectives


_EXPERT_PARALLEL = ((4, None), (3, "batched_mm"))  # (experts, implementation); None: read from the checkpoint


def _expert_parallel_models(directory: str) -> list:
    return with_default_inputs(
        [
            mixtral(experts=experts, layers=1, implementation=implementation)
            if implementation
            else pretrained(directory)
            for experts, implementation in _EXPERT_PARALLEL
        ]
    )


def _expert_parallel_exact(rank: int, world: int, directory: str) -> None:
    """Whole experts per rank (imposed): 4 experts as 2 + 2 with grouped matmuls, read per rank from transformers'
    per-expert checkpoint and saved back, and 3 as 2 + 1 with ``w[ids]`` + bmm; each rank computes its own
    experts' tokens and the MoE layer's one all-reduce sums the disjoint rows."""
    for experts, implementation in _EXPERT_PARALLEL:
        model = mixtral(experts=experts, layers=1, implementation=implementation)
        if implementation is None:
            sharded = autotp.from_pretrained(directory, experts="parallel")
        else:
            sharded = autotp.parallelize(model, experts="parallel")
        plan = sharded.autotp_plan
        local = dict(sharded.named_parameters())
        first, count = [(0, 2), (2, experts - 2)][rank]
        for param in expert_params(model):  # whole experts: this rank's rows of the full tensor, nothing else
            torch.testing.assert_close(local[param], model.get_parameter(param)[first : first + count], rtol=0, atol=0)
            span = "0-1|2-3" if experts == 4 else "0-1|2"
            assert plan.styles[param].startswith(f"experts {span} of {experts}"), plan.styles[param]
        assert plan.collective_counts("forward")["all_reduce"] <= 2 + 1, plan.collectives  # Megatron's, 1 block
        moe = [c for c in plan.collectives if c["phase"] == "forward" and ".mlp" in c["module"]]
        assert [c["op"] for c in moe] == ["all_reduce"], moe  # the MoE layer's one all-reduce sums the experts
        runs_the_plan(sharded, plan, torch.randint(0, 96, (2, 5)))
        same_as_unsharded(model, sharded, lambda b, s: torch.randint(0, 96, (b, s)))
        if implementation is None:  # greedy decoding through whole experts; written back as transformers does
            ids = torch.randint(3, 96, (2, 5))
            got = autotp.generate(sharded, ids, max_new_tokens=4)
            assert torch.equal(got, model.generate(ids, max_new_tokens=4, do_sample=False)), got
            autotp.save_pretrained(sharded, f"{directory}/saved")


def test_expert_parallelism_is_exact(tmp_path):
    from safetensors.torch import load_file

    mixtral(layers=1).save_pretrained(tmp_path)  # experts stored one by one (experts.E.w1.weight, ...)
    run_ranks(
        2, _expert_parallel_exact, str(tmp_path), captures=functools.partial(_expert_parallel_models, str(tmp_path))
    )
    stored, saved = load_file(tmp_path / "model.safetensors"), load_file(tmp_path / "saved" / "model.safetensors")
    assert stored.keys() == saved.keys() and all(torch.equal(stored[k], saved[k]) for k in stored)


def test_the_cost_model_chooses_the_expert_strategy():
    """Left free, the solver takes the cheaper way to split experts, priced beside the other (each the best
    plan with it imposed).  Gate/up pairs interleaved in 2 x 6 columns cannot be split in whole pairs on 4
    ranks, so expert tensor parallelism leaves the gate/up work whole on every rank and costs more: whole
    experts are chosen.  With 2 x 48 columns both can split; whichever is cheaper is taken."""
    for ffn in (6, 48):
        model, args = moe.build(blocks=1, ffn=ffn, interleaved=True, bias=True)
        plan = autotp.plan(model, args, world_size=4)
        seconds = plan.cost["experts"]["seconds"]
        assert plan.cost["seconds"] <= min(seconds.values()) * (1 + 1e-6), (plan.cost, seconds)
        cheaper = min(seconds, key=seconds.get)
        assert plan.cost["experts"]["chosen"] == cheaper, plan.cost["experts"]
        if ffn == 6:
            assert cheaper == "parallel", seconds
            assert plan.params["0.gate_up"] == plan.params["0.down"] == "S(0/6)", plan.params  # 2,2,1,1 experts
            assert plan.styles["0.gate_up"].startswith("experts 0-1|2-3|4|5 of 6"), plan.styles


def test_compare_prices_transformers_expert_plans():
    """transformers' Mixtral tp_plan (experts split: packed gate|up columns, down rows) and its ep_plan (whole
    experts) read as autotp placements and priced beside autotp's own plan, which is never slower."""
    from autotp.tools.compare import compare
    from autotp.tools.interop import hf_parameter_placements

    model = mixtral(layers=1)
    tp, ep = hf_parameter_placements(model), hf_parameter_placements(model, expert_parallel=True)
    experts = "model.layers.0.mlp.experts"
    assert (str(tp[f"{experts}.gate_up_proj"]), str(tp[f"{experts}.down_proj"])) == ("S(1|48,48)", "S(2)"), tp
    assert str(ep[f"{experts}.gate_up_proj"]) == str(ep[f"{experts}.down_proj"]) == "S(0)", ep
    result = compare(model, world_size=2)
    assert result["hf"] and result["hf_ep"], result
    assert result["autotp"]["seconds"] <= min(result["hf"]["seconds"], result["hf_ep"]["seconds"]) * (1 + 1e-6)


def test_why_whole_experts_cost_more_for_mixtral_8x7b():
    """One Mixtral-8x7B layer at TP 8 on dgx-h100 (meta device, 1 x 4096 tokens, training): whole experts and split
    experts hold the same expert bytes per device and run the same collectives for the MoE layer.  Priced by their
    shapes, whole experts' products are the cheaper ones, by the ratio the H200 measured for these shapes (README
    Benchmarks); what makes today's whole experts cost more is the rows of other ranks' experts, kept as zeros at
    full size (the all-to-all dispatch of issue 25 keeps only a rank's own rows), and the solver takes the sum."""
    from transformers import MixtralForCausalLM

    from autotp.cost_models import load_topology
    from autotp.cost_models.pricing import op_seconds, priced_unit
    from autotp.ops.strategies import Strategy
    from autotp.options import PlanOptions
    from autotp.passes.prepared_graph import prepared_graph
    from autotp.placement import parse
    from autotp.planning.tensor_plan import solve_plan

    config = configs.mixtral_8x7b(num_hidden_layers=1, max_position_embeddings=32768, use_cache=False)
    with torch.device("meta"):
        model = MixtralForCausalLM(config).to(torch.bfloat16)
    gm = prepared_graph(model, (torch.zeros(1, 4096, dtype=torch.long, device="meta"),), None, fold=False)
    topo, (_, sizes) = load_topology("dgx-h100"), priced_unit(gm)
    plans = {
        mode: solve_plan(gm, 8, PlanOptions(topology=topo, memory_limit=1e13, experts=mode), sizes=sizes)
        for mode in ("tensor", "parallel", None)
    }
    assert plans["parallel"].params["model.layers.0.mlp.experts.down_proj"] == "S(0)"  # one expert per rank
    assert plans["tensor"].cost["memory"]["params"] == plans["parallel"].cost["memory"]["params"]

    def moe_collectives(plan):
        return sorted((c["phase"], c["op"], c["bytes"]) for c in plan.collectives if ".mlp" in c["module"])

    assert moe_collectives(plans["tensor"]) == moe_collectives(plans["parallel"])
    experts = "model.layers.0.mlp.experts"
    kept = {mode: plans[mode].cost["activations"][experts] for mode in ("tensor", "parallel")}
    assert kept["parallel"] > 2 * kept["tensor"], kept

    nodes = {n.name: n for n in gm.graph.nodes}

    def seconds(mode: str, products: bool) -> float:
        return sum(
            op_seconds(nodes[name], Strategy(tuple(map(parse, e["in"])), parse(e["out"])), sizes, 8, topo, True)
            for name, e in plans[mode].nodes.items()
            if e["module"].startswith("model.layers.0.mlp") and (e["op"] == "aten._grouped_mm.default") == products
        )

    # measured on one H200, bf16, fraction of peak (README Benchmarks, midpoints): a rank's products at 1024 rows
    # an expert; expert TP: 8 experts' gate|up 1024x4096x3584 at 0.49 and down 1024x1792x4096 at 0.415; whole
    # experts: one expert's 1024x4096x28672 and 1024x14336x4096, both at 0.715 -- the same FLOPs
    measured = 8 * (1 / 0.49 + 0.5 / 0.415) / (8 / 0.715 + 4 / 0.715)
    ratio = seconds("tensor", True) / seconds("parallel", True)
    assert measured / 1.15 <= ratio <= measured * 1.15, (ratio, measured)
    saved, zeros = (
        seconds("tensor", True) - seconds("parallel", True),
        seconds("parallel", False) - seconds("tensor", False),
    )
    assert 0 < saved < zeros, (saved, zeros)  # the zero rows' elementwise work outweighs the thin products
    cheaper = min(("tensor", "parallel"), key=lambda mode: plans[mode].cost["seconds"])
    assert plans[None].cost["seconds"] == pytest.approx(plans[cheaper].cost["seconds"], rel=1e-6)


class _Lookups(torch.nn.Module):
    """Rows of expert tables looked up by ids and multiplied: only rows routed by the same ids to tables of
    as many experts are held by the same rank, so only their product may stay a disjoint partial sum."""

    def __init__(self):
        super().__init__()
        self.a, self.c = torch.nn.Parameter(torch.randn(4, 8)), torch.nn.Parameter(torch.randn(4, 8))
        self.b = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x, ids, other):
        same = self.a[ids] * self.c[ids]
        rerouted = self.a[ids] * self.c[other]
        more_experts = self.a[ids] * self.b[ids]
        return x + same + rerouted + more_experts


def test_disjoint_rows_multiply_only_when_routed_alike():
    """The solver is offered the product of two disjoint partials only for rows routed by the same ids to
    tables of as many experts (the others are exact only reduced first)."""
    ids, other = torch.tensor([0, 3, 1, 2, 3]), torch.tensor([2, 0, 0, 3, 1])
    plan = autotp.plan(_Lookups(), (torch.randn(5, 8), ids, other), world_size=2, experts="parallel")
    lookups = {name: n["args"][:2] for name, n in plan.nodes.items() if n["op"] == "aten.index.Tensor"}
    products = {name: n["args"] for name, n in plan.nodes.items() if n["op"] == "aten.mul.Tensor"}
    alike = {
        name: lookups[x][1] == lookups[y][1] and {lookups[x][0], lookups[y][0]} <= {"a", "c"}
        for name, (x, y) in products.items()
    }
    assert sorted(alike.values()) == [False, False, True], (lookups, products)
    for name, both in alike.items():
        offered = [option["in"] for option in plan.alternatives[name]]
        assert (["D(0)", "D(0)"] in offered) == both, (name, offered)
