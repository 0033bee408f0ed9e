"""Attention heads split across ranks, whatever the KV layout: separate or fused q/k/v, grouped KV heads,
one KV head (multi-query), KV heads that do not divide the ranks.  Forward communication must be
Megatron's (two all-reduces per block, at most two more for the whole model), counted with
CommDebugMode, and outputs and gradients must equal the single-process model's."""

from __future__ import annotations

import functools
import re
from collections import Counter

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

import autotp
from autotp.placement import parse, take_local
from tests.helpers import configs
from tests.helpers.distributed import comm_counts, plan_ops, run_ranks
from tests.helpers.exact import TOL
from tests.helpers.models import logits

LAYERS = 2
# Plans are priced at the example inputs' size: 1024 tokens.  There latency still weighs: a multi-query model's
# plan keeps Megatron's layout because the gradients of the KV blocks every rank holds, weight and bias, are
# summed by one all-reduce (priced with one latency); priced as two, a row-split qkv with a reduce-scatter
# looked cheaper at this size (3 forward collectives per block).
EXAMPLE = (16, 64)


def build(kind: str):
    """A tiny Hugging Face decoder with the named head layout (random weights, fixed seed)."""
    torch.manual_seed(0)
    if kind.startswith("llama"):  # llama-H-KV: separate q/k/v projections
        from transformers import LlamaForCausalLM

        heads, kv = map(int, kind.split("-")[1:])
        return LlamaForCausalLM(
            configs.llama(
                hidden_size=heads * 8,
                num_attention_heads=heads,
                num_key_value_heads=kv,
                head_dim=8,
                num_hidden_layers=LAYERS,
            )
        ).eval()
    if kind == "phi3":  # fused qkv_proj with GQA sizes [8 heads | 2 KV heads | 2 KV heads], cut by slices
        from transformers import Phi3ForCausalLM

        return Phi3ForCausalLM(
            configs.phi3(num_hidden_layers=LAYERS, pad_token_id=0, bos_token_id=0, eos_token_id=0)
        ).eval()
    if kind == "bigcode":  # multi-query: fused c_attn [8 heads | 1 KV head | 1 KV head], cut by split
        from transformers import GPTBigCodeForCausalLM

        return GPTBigCodeForCausalLM(configs.gpt_bigcode(n_layer=LAYERS)).eval()
    if kind == "gptj":  # rotary on interleaved pairs: x[..., ::2], x[..., 1::2], stack and flatten back
        from transformers import GPTJForCausalLM

        return GPTJForCausalLM(configs.gptj(n_layer=LAYERS)).eval()
    if kind.startswith("falcon"):  # falcon-<multi_query><new_decoder_architecture><bias>[-heads-groups]
        from transformers import FalconForCausalLM

        multi_query, new, bias = (c == "1" for c in kind.split("-")[1])
        heads, groups = falcon_heads(kind)
        return FalconForCausalLM(
            configs.falcon(
                hidden_size=heads * 8,
                num_hidden_layers=LAYERS,
                num_attention_heads=heads,
                num_kv_heads=groups if new else heads,
                multi_query=multi_query,
                new_decoder_architecture=new,
                bias=bias,
            )
        ).eval()
    raise ValueError(kind)


PARALLEL = ("falcon", "gptj")  # attention and MLP read the same input and their outputs are added


def falcon_heads(kind: str) -> tuple[int, int]:
    """Query heads and KV groups (new_decoder_architecture) of a falcon kind: 8 and 2 unless named."""
    return tuple(map(int, kind.split("-")[2:])) or (8, 2)


def falcon_qkv_rows(kind: str, rank: int, world: int) -> set:
    """The rows of Falcon's fused query_key_value weight that a rank computing its share of the H query heads
    (dealt in order, the first H % world ranks one more) needs, from the packing transformers'
    FalconAttention._split_heads reads (head dim 8): multi-query [H q | k | v]; new architecture per KV
    group [H/groups q | k | v]; otherwise per head [q | k | v]."""
    total, groups = falcon_heads(kind)
    base, extra = divmod(total, world)
    heads = range(rank * base + min(rank, extra), (rank + 1) * base + min(rank + 1, extra))
    multi_query, new = (c == "1" for c in kind.split("-")[1][:2])
    if new:
        group = total // groups
        units = {g * (group + 2) + u for h in heads for g in [h // group] for u in [h % group, group, group + 1]}
    elif multi_query:
        units = set(heads) | {total, total + 1}
    else:
        units = {3 * h + u for h in heads for u in range(3)}
    return {8 * u + i for u in units for i in range(8)}


def _block_of(module: str) -> int | None:
    found = re.search(r"\.(\d+)(\.|$)", module)
    return int(found.group(1)) if found else None


def _check(rank: int, world: int, kinds: list) -> None:
    transport = autotp.runtime.transport
    for kind in kinds:
        model, example = _example(kind)
        sharded = autotp.parallelize(model, example)
        plan = sharded.autotp_plan
        if kind.startswith("falcon"):  # the fused qkv is split by heads: each rank holds what its heads need
            for b in range(LAYERS):
                held = parse(plan.params[f"transformer.h.{b}.self_attention.query_key_value.weight"])
                rows = set(take_local(torch.arange(len(falcon_qkv_rows(kind, 0, 1))), held, rank, world).tolist())
                assert rows == falcon_qkv_rows(kind, rank, world), (kind, held)

        if kind in ("bigcode", "falcon-101"):  # every rank holds the KV rows and bias: one all-reduce sums both
            qkv = "attn.c_attn" if kind == "bigcode" else "self_attention.query_key_value"
            sums = Counter(
                c["module"] for c in plan.collectives if c["phase"] == "backward" and c["module"].endswith(qkv)
            )
            assert sums == {f"transformer.h.{b}.{qkv}": 1 for b in range(LAYERS)}, (kind, sums)

        # Megatron's forward communication: per block 2 all-reduces (1 where attention and MLP run side by side),
        # at most 2 more for the model (a vocab-parallel embedding's all-reduce may be deferred into block 0)
        block = 1 if kind.startswith(PARALLEL) else 2
        per_block = Counter(_block_of(c["module"]) for c in plan.collectives if c["phase"] == "forward")
        assert all(per_block[b] <= block for b in range(1, LAYERS)) and per_block[0] <= block + 1, (kind, per_block)
        one_shot, transport.ONE_SHOT_BYTES = transport.ONE_SHOT_BYTES, 0  # count all-reduces as such
        try:
            for batch, seq in [(3, 11), (1, 1)]:
                x = torch.randint(0, 96, (batch, seq))
                with CommDebugMode() as comm:
                    out = logits(sharded(x))
                torch.testing.assert_close(out, logits(model(x)), **TOL, msg=lambda m, k=kind: f"{k}: {m}")
                counts = plan_ops(comm_counts(comm))
                assert sum(counts.values()) <= block * LAYERS + 2, (kind, counts)
                assert counts == plan.collective_counts("forward"), (kind, counts)  # by kind

            # gradients, shared KV heads' included, equal the unsharded model's; the backward runs the
            # collectives the plan reports (with the gradient sums of KV weight rows several ranks hold)
            x = torch.randint(0, 96, (2, 6))
            loss = logits(sharded(x)).square().mean()
            with CommDebugMode() as comm:
                loss.backward()
            assert plan_ops(comm_counts(comm)) == plan.collective_counts("backward"), (kind, comm_counts(comm))
        finally:
            transport.ONE_SHOT_BYTES = one_shot
        logits(model(x)).square().mean().backward()
        grads = autotp.full_state_dict(sharded, grads=True)
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name, k=kind: f"{k} {n}: {m}")
        if kind == "falcon-010" and world == 4:  # the decode program holds the KV groups as training does
            ids = torch.randint(1, 96, (2, 4))
            got = autotp.generate(sharded, ids, max_new_tokens=3, pad_token_id=0)
            assert torch.equal(got, model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)), kind


@pytest.mark.parametrize(
    ("world", "kinds"),
    [
        (2, ["llama-8-1", "falcon-101"]),  # falcon: qkv cut by constant index
        (3, ["phi3", "bigcode", "llama-8-2", "gptj"]),  # 8 heads 3,3,2; rank 1 needs both KV heads
        (
            4,
            [
                "llama-6-3",
                "falcon-100",  # 3 KV heads do not divide 4 ranks
                "falcon-010",
            ],
        ),  # 2 KV groups at 4 ranks: each rank holds 2 query heads and its group's k and v
        pytest.param(2, ["phi3", "bigcode", "falcon-010"], marks=pytest.mark.slow),  # the fused layouts at every size
        pytest.param(3, ["falcon-010"], marks=pytest.mark.slow),
        pytest.param(4, ["phi3", "bigcode"], marks=pytest.mark.slow),
    ],
)
def test_heads_split_whatever_the_kv_layout(world, kinds):
    run_ranks(world, _check, kinds, captures=functools.partial(_examples, kinds))


def _example(kind: str) -> tuple:
    return build(kind), (torch.randint(0, 96, EXAMPLE),)


def _examples(kinds: list) -> list:
    return [_example(kind) for kind in kinds]


def test_explain_prices_the_kv_layouts():
    """8 query heads dealt 3,3,2 over 3 ranks share 2 KV heads: k_proj holds on each rank the KV heads its
    query heads use (rank 1 needs both); `autotp explain` lists that choice beside the replicated
    projection with their costs, and the plan reports the backward all-reduce that sums the shared
    heads' weight gradients."""
    from rich.console import Console

    from autotp.tools.report import explain_table

    plan = autotp.plan(build("llama-8-2"), (torch.randint(0, 96, EXAMPLE),), world_size=3)
    module = "model.layers.0.self_attn.k_proj"
    held = parse(plan.params[f"{module}.weight"])
    query_heads = [
        take_local(torch.arange(8), parse(plan.params["model.layers.0.self_attn.q_proj.weight"]).at(0), r, 3)
        for r in range(3)
    ]
    for rank, heads in enumerate(query_heads):
        kv_rows = take_local(torch.arange(16), held, rank, 3)  # 2 KV heads x 8 rows
        assert sorted(set((kv_rows // 8).tolist())) == sorted(set((heads // 4).tolist())), (rank, held)
    assert {"op": "all_reduce", "phase": "backward", "module": module} in [
        {k: c[k] for k in ("op", "phase", "module")} for c in plan.collectives
    ]

    console = Console(width=200, record=True)
    console.print(explain_table(plan, module))
    rows = [line.split("│")[1:5] for line in console.export_text().splitlines() if "aten.linear.default" in line]
    costs = {(ins.strip(), out.strip()): float(cost) for _, ins, out, cost in rows if cost.strip() != "impossible"}
    chosen = next((ins.strip(), out.strip()) for _, ins, out, _ in rows if str(held) in ins)
    assert ("R, R", "R") in costs and len(costs) >= 3, rows  # replicated K projection, priced
    assert costs[chosen] <= costs[("R, R", "R")], costs


def test_explain_prices_falcon_groups_split_inside():
    """Falcon's new decoder architecture with 3 KV groups of 4 query heads at 4 ranks (the groups do not
    divide the ranks: rank 1's heads 3, 4, 5 span groups 0 and 1): its fused query_key_value is split by
    query heads inside each group, each rank holding the k and v rows of its heads' groups too (the rows
    transformers' packing gives its query heads); the plan's forward is Megatron's, and `autotp explain`
    prices the split beside the replicated and the plain row- and column-split products: it costs least."""
    from rich.console import Console

    from autotp.tools.report import explain_table

    kind = "falcon-010-12-3"
    plan = autotp.plan(build(kind), (torch.randint(0, 96, EXAMPLE),), world_size=4)
    module = "transformer.h.0.self_attention.query_key_value"
    held = parse(plan.params[f"{module}.weight"])
    rows = len(falcon_qkv_rows(kind, 0, 1))
    assert [set(take_local(torch.arange(rows), held, r, 4).tolist()) for r in range(4)] == [
        falcon_qkv_rows(kind, r, 4) for r in range(4)
    ], held
    per_block = Counter(_block_of(c["module"]) for c in plan.collectives if c["phase"] == "forward")
    assert all(per_block[b] <= 1 for b in range(1, LAYERS)) and per_block[0] <= 2, per_block

    console = Console(width=250, record=True)
    console.print(explain_table(plan, module))
    lines = [line.split("│")[1:6] for line in console.export_text().splitlines() if "aten.matmul.default" in line]
    costs = {(ins.strip(), out.strip()): cost.strip() for _, ins, out, cost, _ in lines}
    chosen = next((ins.strip(), out.strip()) for _, ins, out, _, _ in lines if str(held.at(1)) in ins)
    others = [("R, R", "R"), ("R, S(1)", "S(2)"), ("S(2), S(0)", "P")]  # replicated, column split, row split
    assert all(costs[o] != "impossible" and float(costs[chosen]) < float(costs[o]) for o in others), costs


def _from_pretrained_refused(rank: int, world: int, directory: str) -> None:
    with pytest.raises(
        autotp.CheckpointError,
        match=r"lifted_tensor_0 is a tensor the model's forward creates.*"
        r"meta device.*build this model on a real device",
    ):
        autotp.from_pretrained(directory)
    torch.distributed.barrier()  # a rank that returns early takes the rendezvous store with it


def test_falcon_groups_from_pretrained_is_refused_clearly(tmp_path):
    """from_pretrained builds the model on the meta device, where the positions Falcon's forward cuts its KV
    groups with (``[-2]``, ``[-1]``) are unknown: refused with what to do, never run with made-up positions
    (whatever the world size: one rank shows it)."""
    build("falcon-010").save_pretrained(tmp_path)
    run_ranks(1, _from_pretrained_refused, str(tmp_path))
