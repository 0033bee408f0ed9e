"""Any transformer at any TP size: nine Hugging Face architectures at 2, 3 and 4 ranks, running Megatron's
collectives (counted); KV heads fewer than ranks; heads and vocabularies not divisible; vocab-parallel loss; half
precision."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._pytree import tree_leaves

import autotp
from tests.helpers.architectures import NAMES, hf_model, ids, same_as_unsharded
from tests.helpers.distributed import AT_THREE_RANKS, block_of, comm_counts, plan_ops, run_ranks
from tests.helpers.exact import TOL
from tests.helpers.models import llama_with

PARALLEL_BLOCKS = {"gpt_neox", "falcon"}  # attention and MLP read one input and are summed together: one sum a block
# looser than TOL on purpose: half precision rounds to 8 (bf16) or 11 (fp16) significant bits
HALF_PRECISION_TOL = {torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2}, torch.float16: {"rtol": 1e-3, "atol": 1e-3}}


def _megatrons_collectives(name: str, model, sharded) -> None:
    """The collectives CommDebugMode counts in a forward and a backward are the plan's, and the plan's are
    Megatron's or fewer: two sums of partial results a block forward (all-reduces, or reduce-scatters where the
    plan splits the residual stream; one where attention and MLP read the same input, GPT-NeoX's and Falcon's
    parallel blocks; block 0 may also sum the vocab-parallel embedding's), plus at most two outside the blocks
    (embedding, head); backward, at most two activation-gradient sums a block and one outside.  Weights held by
    several ranks (KV heads shared by ranks whose query heads read them) also sum their gradients, as Megatron's
    replicated KV heads do: those are not counted against it."""
    plan = sharded.autotp_plan
    transport = autotp.runtime.transport
    one_shot, transport.ONE_SHOT_BYTES = transport.ONE_SHOT_BYTES, 0  # count small all-reduces as such
    try:
        with CommDebugMode() as forward:
            outputs = [t for t in tree_leaves(dict(sharded(ids(3, 7)))) if t.is_floating_point()]
        loss = sum(t.float().square().mean() for t in outputs)  # every output: BERT's pooler too, as the plan lists
        with CommDebugMode() as backward:
            loss.backward()
    finally:
        transport.ONE_SHOT_BYTES = one_shot
    sharded.zero_grad(set_to_none=True)  # same_as_unsharded compares the gradients of its own backward
    for phase, comm in (("forward", forward), ("backward", backward)):
        assert plan_ops(comm_counts(comm)) == plan.collective_counts(phase), (name, phase, comm_counts(comm))
    blocks = model.config.num_hidden_layers
    weights = {n.replace(".", "_") for n, _ in model.named_parameters()}
    activations = {
        phase: [c for c in plan.collectives if c["phase"] == phase and c["tensor"] not in weights]
        for phase in ("forward", "backward")
    }
    sums = {
        phase: Counter(block_of(c["module"]) for c in found if c["op"] in ("all_reduce", "reduce_scatter"))
        for phase, found in activations.items()
    }
    per_block = 1 if name in PARALLEL_BLOCKS else 2
    assert all(sums["forward"][b] - per_block in ((0, 1) if b == 0 else (0,)) for b in range(blocks)), (name, sums)
    assert len(activations["forward"]) <= 2 * blocks + 2, (name, activations["forward"])
    assert len(activations["backward"]) <= 2 * blocks + 1, (name, activations["backward"])


def _architectures(rank: int, world: int) -> None:
    for name in NAMES:
        model = hf_model(name)
        sharded = autotp.parallelize(model, (torch.randint(0, 90, (2, 5)),))
        _megatrons_collectives(name, model, sharded)
        same_as_unsharded(model, sharded)
        params = sharded.autotp_plan.params
        replicated = [n for n, p in model.named_parameters() if p.dim() == 2 and params.get(n) == "R"]
        assert not replicated, (name, replicated)  # every weight matrix is split, none merely copied


@pytest.mark.parametrize("world", AT_THREE_RANKS)
def test_architectures_match_unsharded(world):
    run_ranks(world, _architectures, captures=_models)


def _models() -> list:
    return [(hf_model(name), (torch.randint(0, 90, (2, 5)),)) for name in NAMES]


def _local_rows(sharded, name: str) -> int:
    return dict(sharded.named_parameters())[name].shape[0]


def _fewer_kv_heads(rank: int, world: int) -> None:
    model = llama_with(heads=8, kv=2)
    sharded = autotp.parallelize(model, (torch.randint(0, 90, (2, 5)),))
    params = sharded.autotp_plan.params
    for proj in ("k_proj", "v_proj"):  # each KV head held by the two ranks whose query heads use it
        assert params[f"model.layers.0.self_attn.{proj}.weight"] == "S(0/2)", params
        assert _local_rows(sharded, f"model.layers.0.self_attn.{proj}.weight") == 8  # one head of 8
    assert params["model.layers.0.self_attn.q_proj.weight"] == "S(0)"
    same_as_unsharded(model, sharded)
    model = llama_with(heads=8, kv=1)  # multi-query
    same_as_unsharded(model, autotp.parallelize(model, (torch.randint(0, 90, (2, 5)),)))


def _fewer_kv_heads_models() -> list:
    return [(llama_with(heads=8, kv=kv), (torch.randint(0, 90, (2, 5)),)) for kv in (2, 1)]


def test_kv_heads_fewer_than_ranks_are_shared():
    run_ranks(4, _fewer_kv_heads, captures=_fewer_kv_heads_models)


def _uneven_heads(rank: int, world: int) -> None:
    model = llama_with(heads=10, kv=10, vocab=101)
    sharded = autotp.parallelize(model, (torch.randint(0, 90, (2, 5)),))
    params = sharded.autotp_plan.params
    assert params["model.layers.0.self_attn.q_proj.weight"] == "S(0/10)", params
    assert _local_rows(sharded, "model.layers.0.self_attn.q_proj.weight") == [24, 24, 16, 16][rank]  # 3,3,2,2 heads
    if params["lm_head.weight"] == "S(0/101)":  # vocab 101 on 4 ranks, if split by vocabulary: 26,25,25,25
        assert _local_rows(sharded, "lm_head.weight") == [26, 25, 25, 25][rank]
    same_as_unsharded(model, sharded)


def _uneven_heads_models() -> list:
    return [(llama_with(heads=10, kv=10, vocab=101), (torch.randint(0, 90, (2, 5)),))]


def test_heads_not_divisible():
    run_ranks(4, _uneven_heads, captures=_uneven_heads_models)


def _vocab_parallel_loss(rank: int, world: int) -> None:
    model = llama_with(heads=4, kv=2, head_dim=16, vocab=100)
    x = torch.randint(0, 100, (2, 7))
    sharded = autotp.parallelize(model, (x,), gather_outputs=False)
    logits = sharded(x).logits
    assert logits.shape[-1] == [34, 33, 33][rank]  # no rank holds the full logits
    labels = x[:, 1:].clone()
    labels[0, 2] = -100
    loss = autotp.parallel_cross_entropy(logits[:, :-1], labels, vocab_size=100)
    want = F.cross_entropy(model(x).logits[:, :-1].flatten(0, 1), labels.flatten())
    torch.testing.assert_close(loss, want, **TOL)
    loss.backward()
    want.backward()
    grads = autotp.full_state_dict(sharded, grads=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    with pytest.raises(ValueError, match="vocabulary slice"):
        autotp.parallel_cross_entropy(logits[..., :5], labels, vocab_size=100)


def _vocab_parallel_models() -> list:
    return [(llama_with(heads=4, kv=2, head_dim=16, vocab=100), (torch.randint(0, 100, (2, 7)),))]


def test_vocab_parallel_cross_entropy():
    run_ranks(3, _vocab_parallel_loss, captures=_vocab_parallel_models)


def _half_model(dtype: torch.dtype) -> torch.nn.Module:
    return llama_with(heads=4, kv=2, head_dim=16).to(dtype)


def _half_models(dtype: torch.dtype) -> list:
    return [(_half_model(dtype), (torch.randint(0, 90, (2, 5)),))]


def _half_precision(rank: int, world: int, dtype: torch.dtype) -> None:
    model = _half_model(dtype)
    sharded = autotp.parallelize(model, (torch.randint(0, 90, (2, 5)),))
    assert next(sharded.parameters()).dtype == dtype
    same_as_unsharded(model, sharded, HALF_PRECISION_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    run_ranks(2, _half_precision, dtype, captures=functools.partial(_half_models, dtype))
