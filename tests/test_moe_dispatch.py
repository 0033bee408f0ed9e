"""Expert parallelism by all-to-all (issue 25): whole experts per rank, every routed row sent to the owner of its
expert and back (runtime/expert_dispatch.py), over the TP group or a mesh's "ep" x "tp" ranks.

Exact against one process for Mixtral, Qwen3-MoE and a DeepSeek-V3 layer (MLA, a shared expert, group-limited and
bias-corrected routing), with 6 experts on 4 ranks and ranks whose experts get no rows; CommDebugMode counts what
the plan lists; each owner's segment runs on exactly the rows routed to its experts (no zero rows of others)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

import autotp
from autotp.runtime.expert_dispatch import ExpertDispatch
from examples import moe
from tests.helpers import configs
from tests.helpers.distributed import comm_counts, plan_ops, run_ranks
from tests.helpers.exact import TOL
from tests.helpers.moe import (
    expert_params,
    mixtral,
    qwen3_moe,
    runs_the_plan,
    same_as_unsharded,
    six_experts,
    six_experts_models,
    with_default_inputs,
)


def deepseek_v3(experts: int = 8, layers: int = 2):
    """DeepSeek-V3's layer at toy size: MLA attention, the first block dense, then routed experts beside one shared
    expert, sigmoid scores, 4 groups of which each token may use 2, a bias that corrects the choice (not the
    weights) and scaled weights."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(
        configs.deepseek_v3(
            num_hidden_layers=layers, n_routed_experts=experts, routed_scaling_factor=2.5, norm_topk_prob=True
        )
    ).eval()
    with torch.no_grad():  # the router starts at zeros (every score ties): give it, and the bias, values
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("gate.weight", "e_score_correction_bias")):
                tensor.normal_(0, 0.3)
    return model


def _starve(model, first: int) -> None:
    """Experts ``first``.. are never chosen: the bias that corrects DeepSeek's choice pushes them out."""
    with torch.no_grad():
        for name, bias in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                bias[first:] = -1e4


def _tokens(b: int, s: int) -> torch.Tensor:
    return torch.randint(0, 96, (b, s))


def _routed_to_owners(model, sharded, x) -> list[int]:
    """Each dispatch ran its segment on exactly the rows routed to this rank's experts (counted from the
    unsharded model's own routing); returns them per MoE layer."""
    chosen = []
    hooks = [
        m.register_forward_pre_hook(lambda _, args: chosen.append(args[1].flatten()))
        for name, m in model.named_modules()
        if name.endswith("mlp.experts")
    ]
    model(x)
    for hook in hooks:
        hook.remove()
    dispatchers = [m for m in sharded.modules() if isinstance(m, ExpertDispatch)]
    sharded(x)
    assert len(dispatchers) == len(chosen) > 0, (len(dispatchers), len(chosen))
    for ids, dispatcher in zip(chosen, dispatchers, strict=True):
        first, count = dispatcher.owners[dispatcher.group.rank]
        assert dispatcher.received == int(((ids >= first) & (ids < first + count)).sum()), (dispatcher.received, ids)
    return [d.received for d in dispatchers]


def _all_to_all_cases(world: int) -> list:
    return {
        2: [
            ("mixtral", lambda: mixtral()),
            ("qwen3-moe batched", lambda: _batched(qwen3_moe())),
            ("deepseek-v3", lambda: deepseek_v3()),
        ],
        4: [
            ("mixtral 6 experts", lambda: mixtral(experts=6)),
            ("qwen3-moe", lambda: qwen3_moe()),
            ("deepseek-v3 starved", lambda: _starved(deepseek_v3())),
        ],
    }[world]


def _all_to_all_models(world: int) -> list:
    return with_default_inputs([build() for _, build in _all_to_all_cases(world)])


def _all_to_all_exact(rank: int, world: int) -> list:
    received = {}
    for name, build in _all_to_all_cases(world):
        model = build()
        sharded = autotp.parallelize(model, experts="all-to-all")
        plan = sharded.autotp_plan
        local = dict(sharded.named_parameters())
        for param in expert_params(model):  # whole experts dealt out: 6 on 4 ranks hold 2, 2, 1, 1
            assert plan.params[param] in (f"A{world}(0)", f"A{world}(0/6)"), (name, param, plan.params[param])
            assert local[param].shape[1:] == model.get_parameter(param).shape[1:], param
        forward = plan.collective_counts("forward")  # per MoE layer: counts, rows, results, and the TP gather
        layers = sum(".mlp.experts" in p and p.endswith("down_proj") for p in plan.params)
        moe = [c for c in plan.collectives if c["phase"] == "forward" and c.get("group") == "tp"]
        assert sorted(c["op"] for c in moe) == ["all_gather"] * layers + ["all_to_all"] * 3 * layers, moe
        assert forward["all_to_all"] == 3 * layers, forward
        runs_the_plan(sharded, plan, _tokens(2, 5))
        same_as_unsharded(model, sharded, _tokens)
        received[name] = [_routed_to_owners(model, sharded, _tokens(b, s)) for b, s in ((3, 11), (1, 1))]
        if name.startswith("mixtral"):  # greedy decoding, token for token: every rank dispatches at every step
            ids = _tokens(2, 5)
            want = model.generate(ids, max_new_tokens=5, do_sample=False)
            assert torch.equal(autotp.generate(sharded, ids, max_new_tokens=5), want)
    return received


def _batched(model):
    model.config._experts_implementation = "batched_mm"  # w[ids] + bmm: rows in slot order, sorted by the dispatch
    return model


def _starved(model):
    _starve(model, 6)  # the last of 4 ranks holds experts 6 and 7
    return model


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 4])  # different models at each size
def test_all_to_all_is_exact(world):
    received = run_ranks(world, _all_to_all_exact, captures=functools.partial(_all_to_all_models, world))
    if world == 4:
        assert all(calls == [0] for calls in received[3]["deepseek-v3 starved"]), received  # its experts: nothing
        assert any(rank["mixtral 6 experts"][1] == [0, 0] for rank in received), received  # 1 x 1: 2 rows, 4 ranks


def _example_exact(rank: int, world: int) -> None:
    """Gate and up interleaved, biases on every expert projection, looked up by the ids: the lookups run on the
    owner from its local ids (examples/moe.py)."""
    model, args = six_experts()
    sharded = autotp.parallelize(model, args, experts="all-to-all")
    assert sharded.autotp_plan.params["0.gate_up_bias"] == "A4(0/6)", sharded.autotp_plan.params
    runs_the_plan(sharded, sharded.autotp_plan, torch.randn(2, 5, 32))
    same_as_unsharded(model, sharded, lambda b, s: torch.randn(b, s, 32))


def test_hand_written_experts_with_biases_are_dispatched():
    run_ranks(4, _example_exact, captures=six_experts_models)


def _mesh_model():
    return mixtral(experts=6, layers=1)


def _mesh_models() -> list:
    return [(_mesh_model(), (_tokens(2, 5),))]  # every layout's model and a replica's batch: one capture


def _mesh_training(rank: int, world: int) -> None:
    """Expert parallelism over data-parallel ranks: each replica its own tokens, dense layers FSDP over "dp" x
    "ep" (HSDP), experts dealt over "ep" (and "tp" with experts="all-to-all", or split over "tp": EP x expert TP),
    their gradients summed over "dp"; three SGD steps equal one process on every replica's tokens."""
    from torch.distributed.device_mesh import init_device_mesh

    for dims, experts in (
        (("dp", "ep"), None),
        (("ep", "tp"), "all-to-all"),
        (("ep", "tp"), "tensor"),
        (("dp", "tp"), "all-to-all"),
    ):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=dims)
        model = _mesh_model()
        reference = copy.deepcopy(model)
        torch.manual_seed(5)
        everyone = [_tokens(2, 5) for _ in range(2 if "tp" in dims else world)]  # a batch per replica
        mine = everyone[rank // 2 if "tp" in dims else rank]
        sharded = autotp.parallelize(model, (mine,), mesh=mesh, experts=experts)
        plan = sharded.autotp_plan
        held = {p: plan.params[p] for p in expert_params(model)}
        want = {"tensor": {"S(1|48,48)", "S(2)"}, "all-to-all": {"A4(0/6)" if "ep" in dims else "A2(0)"}}
        assert set(held.values()) <= want.get(experts, {"A2(0)"}), (dims, held)
        optimizer = torch.optim.SGD(sharded.parameters(), lr=0.1)
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step in range(3):
            with CommDebugMode() as forward:
                loss = sharded(mine).logits.square().mean()
            with CommDebugMode() as backward:
                loss.backward()
            if step == 0:  # the experts' all-to-alls are the plan's (FSDP's own collectives beside them)
                for phase, comm in (("forward", forward), ("backward", backward)):
                    assert (
                        plan_ops(comm_counts(comm)).get("all_to_all", 0)
                        == plan.collective_counts(phase)["all_to_all"]
                        > 0
                    ), (dims, phase, comm_counts(comm))
            optimizer.step()
            optimizer.zero_grad()
            (sum(reference(x).logits.square().mean() for x in everyone) / len(everyone)).backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            full = autotp.full_state_dict(sharded)
            for name, p in reference.named_parameters():
                torch.testing.assert_close(full[name], p.detach(), **TOL, msg=lambda m, n=name, d=dims: f"{d} {n}: {m}")


def test_expert_parallelism_over_data_parallel_ranks_trains_like_one_process():
    run_ranks(4, _mesh_training, captures=_mesh_models)


def test_the_solver_prices_every_expert_strategy_and_keeps_the_cheapest(tmp_path):
    """Expert TP, whole experts computing their rows in place and whole experts by all-to-all (TP 4), or EP x
    expert TP and EP over "ep" x "tp" (EP 2 x TP 2): the plan is the cheapest, says which it is, and `autotp
    explain PLAN experts` lists each with its time.  Gate/up pairs interleaved in 2 x 6 columns cannot be split
    in whole pairs on 4 ranks; in 2 x 48 they can."""
    from autotp.tools.report import explain_table

    winners = set()
    for ffn, world, ep in ((6, 4, 1), (48, 4, 1), (6, 2, 2), (48, 2, 2)):
        model, args = moe.build(blocks=1, ffn=ffn, interleaved=True, bias=True)
        plan = autotp.plan(model, args, world_size=world, ep=ep)
        seconds = plan.cost["experts"]["seconds"]
        assert set(seconds) == ({"tensor", "parallel", "all-to-all"} if ep == 1 else {"tensor", "all-to-all"})
        assert None not in seconds.values(), seconds
        assert plan.cost["seconds"] == pytest.approx(min(seconds.values()), rel=1e-9), (plan.cost, seconds)
        assert plan.cost["experts"]["chosen"] == min(seconds, key=seconds.get), plan.cost["experts"]
        winners.add(plan.cost["experts"]["chosen"])
        plan.save(tmp_path / "plan.json")
        text = _render(explain_table(autotp.Plan.load(tmp_path / "plan.json"), "experts"))
        listed = [line for line in text.splitlines() if "expert" in line.lower() and "ms" not in line]
        assert sum("chosen" in line for line in listed) == 1 and len(listed) >= len(seconds), text
        for mode, value in seconds.items():
            assert f"{value * 1e3:.3f}" in text, (mode, text)
    assert len(winners) >= 2, winners  # neither strategy is always taken


def _render(table) -> str:
    from rich.console import Console

    console = Console(width=200, record=True, file=None)
    with console.capture() as captured:
        console.print(table)
    return captured.get()


def test_all_to_all_is_priced_on_the_links_it_crosses():
    """The same experts dispatched over one node's 8 GPUs (the TP group) and over 2 nodes (TP 8 x EP 2): each rank
    sends less (its rows spread over more owners), but the share leaving the node crosses the network.  At a size
    where bytes, not launch latency, decide (4k tokens of hidden 4096, on the meta device; forward)."""
    with torch.device("meta"):
        model, _ = moe.build(blocks=1, hidden=4096, ffn=1024, experts=16)
    args = (torch.empty(2, 2048, 4096, device="meta"),)
    per_byte = {}
    for ep in (1, 2):
        plan = autotp.plan(
            model, args, world_size=8, ep=ep, topology="2x-dgx-h100", experts="all-to-all", training=False
        )
        moved = [c for c in plan.collectives if c["op"] == "all_to_all" and not c.get("counts")]
        assert moved and {c["group"] for c in moved} == {"tp" if ep == 1 else "ep x tp"}, moved
        per_byte[ep] = max(c["seconds"] / c["bytes"] for c in moved)
    assert per_byte[2] > 3 * per_byte[1], per_byte
