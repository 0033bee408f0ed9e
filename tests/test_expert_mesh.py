"""The mesh planner's expert-parallel degree: who holds which experts, what the all-to-all costs on the links it
crosses, what fuller expert groups save, and the published layouts of Mixtral-8x7B and DeepSeek-V3 (estimates,
meta device)."""

from __future__ import annotations

import pytest
import torch

from autotp.cost_models import expert_layout as moe
from autotp.cost_models import load_topology
from autotp.cost_models.compute import product_time
from autotp.cost_models.mesh_layout import Candidate, Setting, price
from autotp.passes.prepared_graph import prepared_graph
from autotp.planning.mesh_search import plan_mesh_for_graph
from tests.helpers import configs


def _mixtral_experts(tp: int) -> moe.Experts:
    """One Mixtral-8x7B MoE layer's experts at 4096 tokens a sample, split over tp ranks (expert TP)."""
    topo = load_topology("dgx-h100")
    rows, hidden, ffn = 4096 * 2 / 8, 4096, 14336
    products = [(rows, 2 * ffn / tp, hidden, 2 * ffn, hidden), (rows, hidden, ffn / tp, hidden, ffn)]
    seconds = 3 * sum(product_time(r, n, k, topo, 8, ragged=True) for r, n, k, _, _ in products)
    whole = 8 * 3 * hidden * ffn * 2
    return moe.Experts(8, products, seconds, 4096 * 2 * hidden * 2, {"params": whole / tp}, {"params": whole})


def test_expert_parallel_degrees_divide_the_experts_and_the_ranks_they_come_from():
    experts = _mixtral_experts(2)
    assert moe.options(None, 2, 8) == [(1, 2)]
    found = moe.options(experts, 2, 8)
    assert (1, 2) in found and all(8 % ep == 0 for ep, _ in found)
    assert all(8 % ep == 0 for ep, etp in found if etp == 2)  # EP over data-parallel replicas
    assert all(ep % 2 == 0 and 16 % ep == 0 for ep, etp in found if etp == 1)  # over dp x tp, whole experts
    assert (2, 1) in found and (8, 1) in found and (8, 2) in found


def test_whole_experts_run_in_fuller_groups_and_pay_all_to_alls_on_the_links_they_cross():
    """Same expert FLOPs on every rank: EP 8 over 8 ranks computes one expert's 8x rows instead of 8 thin slices
    (the H200 measured 0.40-0.51 of peak for the slices, 0.69-0.74 whole); the all-to-alls of an EP group inside a
    node go over NVLink, those of a group across two nodes send half of each rank's rows over its NIC."""
    topo = load_topology("dgx-h100", nodes=8)
    tensor = _mixtral_experts(8)
    assert moe.product_seconds(tensor, 8, 8, 1, 1.0, topo) < 0.8 * tensor.seconds
    assert moe.product_seconds(tensor, 8, 8, 1, 1.2, topo) > moe.product_seconds(tensor, 8, 8, 1, 1.0, topo)
    inside = moe.all_to_all_seconds(_mixtral_experts(1), 1, 1, 8, 1, 1.0, topo)  # 8 neighbours: one node
    across = moe.all_to_all_seconds(_mixtral_experts(2), 1, 2, 8, 2, 1.0, topo)  # 8 replicas 2 apart: two nodes
    sent = _mixtral_experts(2).routed_bytes
    assert across >= 4 * (sent / 2) / topo.nic_bandwidth > 2 * inside  # dispatch and combine, forward and backward


def test_each_rank_holds_its_experts():
    """With DDP every replica holds what its layout gives it: the expert state of a rank falls as 1/ep; the
    rest of the block does not change."""
    from autotp.cost_models.mesh_layout import Profile, Section

    experts = _mixtral_experts(1)
    state = {"params": 1e9 + experts.state["params"]}
    profile = Profile(1, [Section(), *[Section(1e-3, dict(state), experts) for _ in range(4)], Section()], 0.0, True)
    setting = Setting(load_topology("dgx-h100", nodes=8), 64, True, "ddp", 1e15, 0.0)
    held = {ep: price(profile, Candidate(1, 1, 64, ep, 1, microbatch_size=1), setting).memory_bytes for ep in (1, 2, 8)}
    buffers = {ep: moe.buffer_bytes(experts, 1, 1, ep, 1, 1.0) for ep in held}
    for ep in (2, 8):
        assert held[1] - (held[ep] - buffers[ep]) == pytest.approx(4 * experts.state["params"] * (1 - 1 / ep))


def test_the_planner_offers_expert_parallelism_where_the_graph_routes_experts():
    """Read from the graph, not from names: examples/moe.py's experts (looked up per token and multiplied by bmm)
    get expert-parallel layouts, with their degree in the choice; a model without routed experts gets none."""
    from autotp.planning.mesh_search import plan_mesh
    from examples import moe as example
    from tests.helpers.models import build

    routed = plan_mesh(*example.build(), devices=8, global_batch=16)
    assert {c.ep for c in routed.candidates} == {1, 2}  # 6 experts: EP 2 divides them and the 8 ranks
    assert {"ep", "etp"} <= set(routed.to_dict()["choice"])
    model, args, _ = build("llama", blocks=2)
    assert {c.ep for c in plan_mesh(model, args, devices=4, global_batch=8).candidates} == {1}


@pytest.fixture(scope="module")
def mixtral_8x7b():
    from transformers import MixtralForCausalLM

    config = configs.mixtral_8x7b(max_position_embeddings=32768, use_cache=False)
    with torch.device("meta"):
        model = MixtralForCausalLM(config).to(torch.bfloat16)
    return prepared_graph(model, (torch.zeros(1, 4096, dtype=torch.long, device="meta"),), None, fold=True)


@pytest.mark.slow
def test_mixtral_8x7b_on_64_h100s_deals_experts_out_like_megatron(mixtral_8x7b):
    """Megatron-LM's MoE guide: Mixtral-8x7B on 8 nodes of 8 H100 (GBS 256, sequence 4096, bf16, all-to-all
    dispatch) runs TP 1 x EP 8 x PP 4 at 468 TFLOP/s a GPU (MCore v0.9).  The planner deals the experts out 8 ways
    inside a node, faster than any layout without expert parallelism; the published layout fits 80 GB and is
    estimated within 30% of its measured rate; MFU counts the active parameters (12.9B of 46.7B)."""
    result = plan_mesh_for_graph(mixtral_8x7b, topology="dgx-h100", nodes=8, global_batch=256)
    c = result.choice
    assert c.ep > 1 and (c.ep if c.etp == 1 else c.ep * c.tp) <= 8, c  # the EP group spans one node
    no_ep = min(x.step_seconds for x in result.candidates if x.fits and x.ep == 1)
    assert c.step_seconds < no_ep
    megatron = next(x for x in result.candidates if (x.tp, x.pp, x.ep) == (1, 4, 8))
    assert megatron.fits
    rate = megatron.mfu * load_topology("dgx-h100").peak_flops
    assert 0.7 * 468e12 <= rate <= 1.3 * 468e12, rate / 1e12
    per_token = c.mfu * 64 * load_topology("dgx-h100").peak_flops * c.step_seconds / (256 * 4096)
    attention = 3 * 4 * 32 * 4096 * 4096  # 3 x (QK^T + PV) per token and layer, unmasked (Narayanan et al.)
    assert 6 * 12.9e9 <= per_token <= 6 * 12.9e9 + 1.1 * attention, per_token / 1e9


@pytest.mark.slow
def test_deepseek_v3_on_2048_h800s_pipelines_and_deals_experts_without_tensor_parallelism():
    """DeepSeek-V3 (arXiv 2412.19437, section 3.2): 671B parameters on 2,048 H800, PP 16 x EP 64 (8 nodes) x ZeRO-1
    DP, no TP, all-to-alls hidden behind compute by DualPipe.  The planner (bf16 products, 1F1B, full
    recomputation: DeepSeek's FP8, DualPipe and selective recomputation are not modelled) lays it out with no TP,
    pipeline stages and experts dealt out; the published layout fits 80 GB.  All-to-alls priced exposed keep the
    EP group inside a node; hidden (DualPipe), the EP group spans nodes, as published."""
    from transformers import DeepseekV3ForCausalLM

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(configs.deepseek_v3_671b(use_cache=False)).to(torch.bfloat16)
    assert 670e9 < sum(p.numel() for p in model.parameters()) < 672e9
    gm = prepared_graph(model, (torch.zeros(1, 4096, dtype=torch.long, device="meta"),), None, fold=True)
    choices = {}
    for overlap in (0.0, 1.0):
        result = plan_mesh_for_graph(gm, topology="dgx-h800", nodes=256, global_batch=15360, overlap_all_to_all=overlap)
        c = choices[overlap] = result.choice
        assert c.tp == 1 and c.pp > 1 and c.ep > 1, c
        published = next(x for x in result.candidates if (x.tp, x.pp, x.ep) == (1, 16, 64))
        assert published.fits, published.note
    assert choices[0.0].ep <= 8 < choices[1.0].ep, choices
