"""Plans in DTensor's and Hugging Face's words, checked by running them."""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.tools.interop import to_dtensor_plan, to_hf_tp_plan
from tests.helpers import configs
from tests.helpers.distributed import comm_counts, plan_ops, run_ranks
from tests.helpers.exact import TOL
from tests.helpers.models import build, example_input, logits


def _dtensor_runs_the_plan(rank: int, world: int, kind: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    model, args, _ = build(kind)
    reference, _, _ = build(kind)
    plan = autotp.plan(model, args, world_size=world)
    styles, unsupported = to_dtensor_plan(plan)
    assert not unsupported, unsupported
    assert styles, "the plan shards something"
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, styles)
    x = example_input(kind, 3, 5)
    torch.testing.assert_close(logits(model(x)), logits(reference(x)), **TOL)


def test_dtensor_plan_runs_mlp():
    run_ranks(2, _dtensor_runs_the_plan, "mlp")


def test_dtensor_plan_runs_llama():
    run_ranks(2, _dtensor_runs_the_plan, "llama")


def test_fused_projections_are_reported_not_expressible():
    model, args, _ = build("nanogpt", device="meta")
    styles, unsupported = to_dtensor_plan(autotp.plan(model, args, world_size=2))
    assert any("c_attn" in m for m in unsupported) and all("c_attn" not in m for m in styles)
    assert "h.0.mlp.0" in styles


def test_uneven_heads_are_reported_not_expressible():
    from tests.helpers.models import llama_with

    with torch.device("meta"):
        model = llama_with(heads=10, kv=10)
    styles, unsupported = to_dtensor_plan(autotp.plan(model, (torch.zeros(2, 8, dtype=torch.long),), world_size=4))
    assert "uneven" in unsupported["model.layers.0.self_attn.q_proj"]
    assert "model.layers.0.self_attn.q_proj" not in styles


def test_hf_tp_plan_folds_layers_and_matches_transformers_own():
    model, args, _ = build("llama", device="meta")
    hf_plan, unsupported = to_hf_tp_plan(autotp.plan(model, args, world_size=2))
    assert not unsupported
    own = model.config.base_model_tp_plan
    for pattern, style in own.items():  # transformers' plan for LLaMA is Megatron's: ours must agree
        assert hf_plan[f"model.{pattern}"] == style, pattern


def _communicates_no_more_than_hf(rank: int, world: int, kind: str, directory: str, predicted: dict) -> None:
    import os

    from torch.distributed.tensor.debug import CommDebugMode

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    model_class = type(build(kind, device="meta")[0])
    hf = model_class.from_pretrained(directory, tp_plan="auto").eval()  # transformers' own TP (DTensor)
    model = model_class.from_pretrained(directory).eval()
    x = example_input(kind, 3, 5)
    sharded = autotp.parallelize(model, (x,))
    autotp.runtime.transport.ONE_SHOT_BYTES = 0  # count all-reduces as such (on gloo small ones run as all-gathers)

    def counts(module) -> tuple[dict, dict]:
        """(forward, backward) collectives of one training step, in the plan's names."""
        with CommDebugMode() as forward:
            loss = logits(module(x)).float().square().mean()
        with CommDebugMode() as backward:
            loss.backward()
        return plan_ops(comm_counts(forward)), plan_ops(comm_counts(backward))

    (ours, ours_back), (theirs, theirs_back) = counts(sharded), counts(hf)
    assert (predicted["forward"], predicted["backward"]) == (theirs, theirs_back), (predicted, theirs, theirs_back)
    plan = sharded.autotp_plan
    assert ours == plan.collective_counts("forward") and ours_back == plan.collective_counts("backward"), (
        ours,
        ours_back,
        plan.collectives,
    )
    blocks = model.config.num_hidden_layers
    # Megatron's count: two all-reduces per block forward plus one each for the embedding and the head;
    # backward, the conjugate all-reduce before attention and MLP in each block and one before the head
    assert ours.get("all_reduce", 0) <= 2 * blocks + 1 and ours.get("all_gather", 0) <= 1, ours
    assert set(ours) <= {"all_reduce", "all_gather"} and sum(ours_back.values()) <= 2 * blocks + 1, (ours, ours_back)
    for op, n in ours.items():
        assert n <= theirs.get(op, 0), (op, ours, theirs)
    # backward, each kind priced by the same cost model at the same sizes (the kinds were just measured)
    ours_seconds = sum(c["seconds"] * c["count"] for c in plan.collectives if c["phase"] == "backward")
    assert ours_seconds < predicted["comm_seconds"]["backward"], (ours_back, theirs_back)
    if kind == "llama":  # transformers' plan for LLaMA is Megatron's with a vocabulary-parallel embedding and head
        assert theirs == {"all_reduce": 2 * blocks + 1, "all_gather": 1}, theirs
        assert sum(ours.values()) == sum(theirs.values()), (ours, theirs)
    if kind == "phi3":  # transformers gathers the fused qkv and gate_up outputs of every block
        assert theirs == {"all_reduce": 2 * blocks + 1, "all_gather": 2 * blocks + 1}, theirs
    torch.testing.assert_close(logits(sharded(x)), logits(model(x)), **TOL)


@pytest.mark.parametrize("kind", ["llama", pytest.param("phi3", marks=pytest.mark.slow)])
def test_no_more_communication_than_hf_tp_plan(kind, tmp_path):
    """Collectives of a training step counted with CommDebugMode: autotp vs transformers' tp_plan="auto"
    (the figures the README states), and autotp's against its plan's prediction and Megatron's count."""
    from autotp.tools.compare import compare

    model, _, _ = build(kind)
    model.save_pretrained(tmp_path)
    predicted = compare(model, (example_input(kind, 3, 5),), world_size=2)["hf"]  # `autotp compare`'s HF column
    run_ranks(2, _communicates_no_more_than_hf, kind, str(tmp_path), predicted)


def _transformers_counts(rank: int, world: int, directory: str, expert_parallel: bool, ids, predicted) -> None:
    import os

    from torch.distributed.tensor.debug import CommDebugMode
    from transformers import MixtralForCausalLM
    from transformers.distributed import DistributedConfig

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    config = DistributedConfig(tp_plan="auto", enable_expert_parallel=expert_parallel)
    hf = MixtralForCausalLM.from_pretrained(directory, distributed_config=config)
    with CommDebugMode() as forward:
        loss = hf(ids).logits.float().square().mean()
    with CommDebugMode() as backward:
        loss.backward()
    measured = plan_ops(comm_counts(forward)), plan_ops(comm_counts(backward))
    if not expert_parallel:
        assert measured == (predicted["forward"], predicted["backward"]), (measured, predicted)
        return
    # whole experts: transformers also gathers each layer's routing-weight gradients in the backward (its token
    # slice of them), which the priced assignment keeps whole; every other count is the same
    assert measured[0] == predicted["forward"], (measured, predicted)
    back = dict(predicted["backward"])
    assert {k: v for k, v in measured[1].items() if k != "all_gather"} == {
        k: v for k, v in back.items() if k != "all_gather"
    }, (measured, predicted)
    assert 0 < back["all_gather"] <= measured[1]["all_gather"], (measured, predicted)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_compare_counts_what_transformers_runs_for_experts(expert_parallel, tmp_path):
    """transformers' Mixtral plans as `autotp compare` prices them (experts split by its tp_plan; whole experts by
    its ep_plan, tokens dispatched by all-to-all) run exactly the collectives compare counts, by kind."""
    from transformers import MixtralForCausalLM

    from autotp.tools.compare import compare

    torch.manual_seed(0)
    model = MixtralForCausalLM(configs.mixtral(vocab_size=64, max_position_embeddings=131072, use_cache=True))
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 64, (3, 5))
    result = compare(model, (ids,), world_size=2)
    predicted = result["hf_ep"] if expert_parallel else result["hf"]
    assert not predicted["unpriced"], predicted
    run_ranks(2, _transformers_counts, str(tmp_path), expert_parallel, ids, predicted)


def _torchtitan_counts(rank: int, world: int, directory: str, ids, predicted: dict) -> None:
    """torchtitan's LLaMA plan (models/llama3/infra/parallelize.py, apply_tp) written on transformers' module names
    and run by DTensor's parallelize_module: the collectives of a training step, counted by CommDebugMode."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory)
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(
        model,
        mesh,
        {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    shard_in = PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
    )
    for layer in model.model.layers:
        parallelize_module(
            layer,
            mesh,
            {
                "input_layernorm": SequenceParallel(),
                "self_attn": shard_in,
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                "post_attention_layernorm": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    positions = torch.arange(ids.shape[1])  # the blocks see a shard of the tokens: the positions are the whole's
    with CommDebugMode() as forward:
        loss = model(ids, position_ids=positions[None], cache_position=positions).logits.float().square().mean()
    with CommDebugMode() as backward:  # the norm weights' gradients are left Partial: summed as the step reads them
        loss.backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    measured = plan_ops(comm_counts(forward)), plan_ops(comm_counts(backward))
    assert measured == (predicted["forward"], predicted["backward"]), (measured, predicted)


def test_compare_counts_what_dtensor_runs_for_torchtitans_plan(tmp_path):
    """`autotp compare`'s "dtensor" column (torchtitan's plan, Megatron's with sequence parallelism: one
    reduce-scatter of q, k and v's input gradient a sublayer, not three) is what DTensor runs, by kind."""
    from autotp.tools.compare import compare

    model, _, _ = build("llama")
    model.save_pretrained(tmp_path)
    ids = example_input("llama", 2, 6)  # a sequence of whole shards: Shard(1) splits it evenly
    predicted = compare(model, (ids,), world_size=2, against=("dtensor",))["dtensor"]
    assert predicted and not predicted["unpriced"], predicted
    run_ranks(2, _torchtitan_counts, str(tmp_path), ids, predicted)
