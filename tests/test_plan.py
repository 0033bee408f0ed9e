"""Planning without a process group: decisions, the plan file, and clear errors."""

from __future__ import annotations

import json
import re

import pytest
import torch

import autotp
from autotp.placement import Shard, parse
from autotp.plan import PlanMismatch
from tests.helpers import configs
from tests.helpers.models import build

MEGATRON = {  # parameter-name suffix -> expected placement, per architecture (checked, never used to plan)
    "llama": {
        "q_proj.weight": "S(0)",
        "k_proj.weight": "S(0)",
        "v_proj.weight": "S(0)",
        "o_proj.weight": "S(1)",
        "gate_proj.weight": "S(0)",
        "up_proj.weight": "S(0)",
        "down_proj.weight": "S(1)",
    },
    "gpt2": {
        "c_attn.weight": "S(1|64,64,64)",
        "c_attn.bias": "S(0|64,64,64)",
        "attn.c_proj.weight": "S(0)",
        "c_fc.weight": "S(1)",
        "mlp.c_proj.weight": "S(0)",
    },
    "phi3": {
        "qkv_proj.weight": "S(0|64,32,32)",
        "o_proj.weight": "S(1)",
        "gate_up_proj.weight": "S(0|128,128)",
        "down_proj.weight": "S(1)",
    },
    "nanogpt": {
        "c_attn.weight": "S(0|32,32,32)",
        "c_proj.weight": "S(1)",
        "mlp.0.weight": "S(0)",
        "mlp.2.weight": "S(1)",
    },
}


@pytest.mark.parametrize("kind", list(MEGATRON))
def test_plan_on_meta_device_is_megatron(kind):
    model, args, blocks = build(kind, device="meta")
    plan = autotp.plan(model, args, world_size=4)
    for suffix, expected in MEGATRON[kind].items():
        matches = [n for n in plan.params if (n.endswith(suffix) and ".0." in n) or (n.endswith(suffix) and ".1." in n)]
        assert len(matches) == blocks, (suffix, matches)
        for name in matches:
            assert plan.params[name] == expected, (name, plan.params[name])


def test_fused_qkv_slices_are_matching_heads():
    """Each rank's slice of a fused [q|k|v] weight holds the same heads of q, k and v."""
    from autotp.placement import assemble, take_local

    full = torch.arange(3 * 8).view(3 * 8, 1)  # rows: q0..q7 | k0..k7 | v0..v7
    shard = Shard(0, (8, 8, 8))
    parts = [take_local(full, shard, r, 4) for r in range(4)]
    assert parts[1].flatten().tolist() == [2, 3, 10, 11, 18, 19]
    assert torch.equal(assemble(parts, shard, 24), full)


def test_plan_json_round_trip_and_mismatches(tmp_path):
    model, args, _ = build("llama", device="meta")
    plan = autotp.plan(model, args, world_size=2)
    path = tmp_path / "plan.json"
    plan.save(path)
    again = autotp.Plan.load(path)
    assert again == plan
    assert again.mesh == {"tp": 2}
    assert isinstance(parse(again.params["model.layers.0.self_attn.q_proj.weight"]), Shard)
    with pytest.raises(PlanMismatch, match="world size 2"):
        again.check(plan.fingerprint, 4)
    with pytest.raises(PlanMismatch, match="another model"):
        again.check("0" * 16, 2)
    path.write_text("{not json")
    with pytest.raises(PlanMismatch, match="corrupt JSON"):
        autotp.Plan.load(path)
    raw = json.loads(plan.to_json())
    for broken, message in [
        ({**raw, "version": 7}, "schema version 7"),
        ({k: v for k, v in raw.items() if k != "params"}, "'params' is a required property"),
        ({**raw, "params": {"w": "S(x)"}}, "at params/w"),
        ({**raw, "world_size": 0}, "at world_size"),
    ]:
        path.write_text(json.dumps(broken))
        with pytest.raises(PlanMismatch, match=re.escape(message)):
            autotp.Plan.load(path)


def test_plan_predicts_forward_collectives():
    model, args, blocks = build("llama", device="meta")
    plan = autotp.plan(model, args, world_size=2)
    forward = [c for c in plan.collectives if c["phase"] == "forward" and c["op"] == "all_reduce"]
    in_blocks = [c for c in forward if ".layers." in c["module"]]
    assert len(in_blocks) == 2 * blocks
    assert all(c["seconds"] > 1e-6 for c in plan.collectives)  # small messages cost microseconds, not zero


def test_missing_inputs_for_a_plain_module_is_a_clear_error():
    model, _, _ = build("mlp")
    with pytest.raises(TypeError, match="pass them"):
        autotp.plan(model, world_size=2)


@pytest.mark.parametrize("bad", [0, -1, 2.0])
def test_bad_world_size(bad):
    model, args, _ = build("mlp")
    with pytest.raises(ValueError, match="world_size"):
        autotp.plan(model, args, world_size=bad)


def test_parallelize_without_process_group_says_what_to_do():
    model, args, _ = build("mlp")
    with pytest.raises(RuntimeError, match="init_process_group"):
        autotp.parallelize(model, args)


def test_hf_model_needs_no_example_inputs():
    model, _, _ = build("llama", device="meta")
    plan = autotp.plan(model, world_size=2)
    assert plan.params["model.layers.0.mlp.down_proj.weight"] == "S(1)"


def test_world_size_one_is_replicated():
    model, args, _ = build("mlp")
    plan = autotp.plan(model, args, world_size=1)
    assert plan.collectives == []


def test_parallel_branches_share_one_all_reduce():
    """Better than Megatron's two: partial sums of parallel branches are added before one all-reduce."""
    from tests.helpers.models import ParallelBranches

    model = torch.nn.Sequential(ParallelBranches(), ParallelBranches())
    plan = autotp.plan(model, (torch.randn(4, 64, 64),), world_size=2)
    forward = [c for c in plan.collectives if c["phase"] == "forward"]
    assert [(c["op"], c["module"]) for c in forward] == [("all_reduce", "0"), ("all_reduce", "1")], forward
    assert plan.params["0.a_in.weight"] == plan.params["0.b_in.weight"] == "S(0)"
    assert plan.params["0.a_out.weight"] == plan.params["0.b_out.weight"] == "S(1)"


@pytest.mark.parametrize("kind,fold", [("llama", False), ("gpt2", True)])
def test_a_plan_is_refused_for_another_split_of_heads(kind, fold):
    """Same parameter shapes, other heads x head dim: only view sizes (and LLaMA's rotary table) differ."""
    from transformers import GPT2LMHeadModel

    from autotp.passes.capture import fingerprint
    from autotp.passes.prepared_graph import prepared_graph
    from autotp.planning.plan_choice import plan_choice
    from tests.helpers.models import llama_with

    layers = 5 if fold else 1

    def model(heads):
        if kind == "llama":
            return llama_with(heads, heads, head_dim=32 // heads, layers=layers)
        return GPT2LMHeadModel(configs.gpt2(n_embd=32, n_layer=layers, n_head=heads, n_positions=16)).eval()

    args = (torch.randint(0, 96, (2, 8)),)
    plan = autotp.plan(model(4), args, world_size=2, fold=fold)
    assert (plan.fold is not None) == fold
    other = prepared_graph(model(2), args, None)
    differs = "constant arguments" + (".*buffer shapes" if kind == "llama" else "")
    with pytest.raises(PlanMismatch, match=f"another model.*differing: [^:]*{differs}[^:]*: re-plan"):
        plan_choice(other, plan, fingerprint(other), 2)
    with pytest.raises(PlanMismatch, match=r"differing: the ops and how they connect\): re-plan"):
        plan.check("0" * 8 + plan.fingerprint[8:], 2)
