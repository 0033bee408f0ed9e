"""Dropout that trains (docs/dropout.md): a model captured in training mode drops in the sharded program.

Reference mode (each rank its piece of the masks one process draws) trains exactly like one process, with and
without sequence parallelism and selective recomputation; the default mode (Megatron's model-parallel RNG) drops
at the rate asked, alike on every rank where the input is whole and apart where it is split, and ranks whose
random generators differ are stopped before they drop differently; eval mode never drops.
"""

from __future__ import annotations

import functools
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

import autotp
from autotp.placement import Shard, take_local
from autotp.runtime.dropout import Attention, Dropout, random_ops
from autotp.tools.report import print_plan
from tests.helpers import configs
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL

P = 0.1


def gpt2(attention: str = "eager", p: float = P, layers: int = 2):
    """GPT-2 dropping everywhere: embeddings, attention probabilities (eager: a dropout op; sdpa: its dropout_p)
    and both residual branches."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    config = configs.gpt2(
        n_layer=layers,
        bos_token_id=0,
        eos_token_id=0,
        attn_pdrop=p,
        resid_pdrop=p,
        embd_pdrop=p,
        attn_implementation=attention,
    )
    return GPT2LMHeadModel(config).train()


def llama(p: float = P):
    """LLaMA with attention dropout: 6 query heads and 2 KV heads (uneven at 4 ranks), SDPA's dropout_p."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(configs.llama(hidden_size=48, num_attention_heads=6, attention_dropout=p)).train()


def _loss(out) -> torch.Tensor:
    return out.logits.float().logsumexp(-1).mean()


def _trains_like_one_process(model, sharded, steps: int = 2) -> None:
    """Each step seeded alike: loss and gradients equal one process's, then both take an SGD step."""
    ours = torch.optim.SGD(sharded.parameters(), lr=0.5)
    theirs = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(steps):
        x = torch.randint(0, 96, (3, 11))
        torch.manual_seed(100 + step)
        loss = _loss(sharded(x))
        loss.backward()
        torch.manual_seed(100 + step)
        out = model(x)
        want = _loss(out)
        want.backward()
        torch.testing.assert_close(loss, want, **TOL)
        grads = autotp.full_state_dict(sharded, grads=True)
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name, k=step: f"step {k}, {n}: {m}")
        with torch.no_grad():  # one process really drops: its eval-mode logits differ
            assert not torch.allclose(model.eval()(x).logits, out.logits, **TOL)
        model.train()
        ours.step(), theirs.step()
        ours.zero_grad(), theirs.zero_grad()


# (model, sequence parallelism, selective recomputation): each attention kind with and without each, and LLaMA
# (SDPA's dropout_p only) at 2 ranks; at 4 ranks (slow tier) both and neither, and LLaMA's uneven heads (6 on 4)
REFERENCE_RUNS = [
    ("eager", False, False),
    ("sdpa", True, False),
    ("eager", True, "selective"),
    ("sdpa", False, "selective"),
    ("llama", False, False),
]


def _reference_runs(world: int) -> list:
    return (
        REFERENCE_RUNS
        if world == 2
        else [("sdpa", True, "selective"), ("eager", False, False), ("llama", False, False)]
    )


def _reference_model(kind: str):
    return llama() if kind == "llama" else gpt2(kind)


def _reference_models(world: int) -> list:
    return [(_reference_model(kind), (torch.randint(0, 96, (2, 16)),)) for kind, _, _ in _reference_runs(world)]


def _reference(rank: int, world: int) -> None:
    warnings.simplefilter("ignore")
    for kind, tokens, recompute in _reference_runs(world):
        model = _reference_model(kind)
        sharded = autotp.parallelize(
            model, (torch.randint(0, 96, (2, 16)),), dropout="reference", sequence_parallel=tokens, recompute=recompute
        )
        kinds = {type(m) for m in random_ops(sharded)}
        assert kinds == ({Attention} if kind == "llama" else {Dropout, Attention} if kind == "sdpa" else {Dropout})
        assert bool(sharded.autotp_plan.cost["token_split"]) == tokens, kind
        assert bool(sharded.autotp_plan.cost["recompute"]) == bool(recompute), kind
        _trains_like_one_process(model, sharded)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_reference_mode_trains_like_one_process(world):
    run_ranks(world, _reference, captures=functools.partial(_reference_models, world))


def _masks(sharded, x) -> list:
    """(layout, zeroed, nonzero input) of every dropout op of one training forward."""
    found = []

    def record(module, args, out):
        found.append((module.layout, out == 0, args[0] != 0))

    hooks = [m.register_forward_hook(record) for m in random_ops(sharded) if isinstance(m, Dropout)]
    sharded(x)
    for hook in hooks:
        hook.remove()
    return found


def _default(rank: int, world: int) -> None:
    import torch.distributed as dist

    from autotp.runtime.rendezvous import random_digest

    warnings.simplefilter("ignore")
    model = gpt2(p=0.25)
    x = torch.randint(1, 96, (4, 32))
    checked = {"whole": 0, "split": 0}
    for tokens in (False, True):
        sharded = autotp.parallelize(model, (x,), sequence_parallel=tokens)
        for layout, mask, values in _masks(sharded, x):
            rate = float((mask & values).sum() / values.sum())  # attention probabilities: causal zeros
            assert abs(rate - 0.25) < 0.03, (layout, rate)  # > 5 sigma at 4 x 32 x 64 / 4 elements
            masks = [None] * world
            dist.all_gather_object(masks, mask)
            same = all(torch.equal(m, masks[0]) for m in masks)
            assert same == (layout is None), (layout, same)  # whole: one mask; split: each rank its own
            checked["whole" if layout is None else "split"] += 1
        digests = [None] * world  # forking each split op's stream leaves the default generators in step
        dist.all_gather_object(digests, random_digest(torch.device("cpu")))
        assert len(set(digests)) == 1
    assert checked["whole"] and checked["split"], checked


def _default_models() -> list:
    return [(gpt2(p=0.25), (torch.randint(1, 96, (4, 32)),))]


def test_default_mode_drops_alike_where_whole_and_apart_where_split():
    run_ranks(2, _default, captures=_default_models)


def _recomputed_alike(rank: int, world: int) -> None:
    """Default mode: a recomputed attention core draws the same masks again (its stream is forked from the
    default generators, which checkpointing restores): gradients equal those of the program that keeps them."""
    warnings.simplefilter("ignore")
    x = torch.randint(0, 96, (3, 11))
    grads = []
    for recompute in (False, "selective"):
        for kind in ("eager", "sdpa"):
            sharded = autotp.parallelize(gpt2(kind), (x,), recompute=recompute)
            assert bool(sharded.autotp_plan.cost["recompute"]) == bool(recompute)
            torch.manual_seed(7)
            _loss(sharded(x)).backward()
            grads.append(autotp.full_state_dict(sharded, grads=True))
    for kept, again in ((grads[0], grads[2]), (grads[1], grads[3])):
        for name in kept:
            torch.testing.assert_close(again[name], kept[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _recomputed_models() -> list:
    return [(gpt2(kind), (torch.randint(0, 96, (3, 11)),)) for kind in ("eager", "sdpa")]


def test_default_mode_recomputes_the_same_masks():
    run_ranks(2, _recomputed_alike, captures=_recomputed_models)


def _seeded_apart(rank: int, world: int) -> None:
    from autotp.runtime.rendezvous import RankDisagreement

    warnings.simplefilter("ignore")
    model = gpt2()
    x = torch.randint(0, 96, (2, 8))
    sharded = autotp.parallelize(model, (x,))
    torch.manual_seed(rank)  # ranks seeded apart (a data-parallel habit)
    sharded.eval()
    sharded(x)  # eval mode draws nothing: nothing to check
    sharded.train()
    with pytest.raises(RankDisagreement, match="random generators' states at call 1 that drops"):
        sharded(x)


def _seeded_apart_models() -> list:
    return [(gpt2(), (torch.randint(0, 96, (2, 8)),))]


def test_ranks_seeded_apart_are_stopped_before_they_drop():
    run_ranks(2, _seeded_apart, captures=_seeded_apart_models)


def _eval_mode(rank: int, world: int) -> None:
    from tests.helpers.models import padded_prompts

    warnings.simplefilter("ignore")
    x = torch.randint(0, 96, (3, 11))
    model = gpt2("sdpa")
    trained = autotp.parallelize(model, (x,), verify=True)  # captured in training mode; verified without dropout
    assert model.training and trained.training
    ids, mask = padded_prompts(96)  # generation never drops, and leaves the model in its mode
    got = autotp.generate(trained, ids, mask, max_new_tokens=4, pad_token_id=0)
    assert model.training
    assert torch.equal(
        got, model.eval().generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    )
    still = autotp.parallelize(model.eval(), (x,))  # captured in eval mode: nothing that draws
    assert not random_ops(still) and not still.autotp_plan.cost["dropout"]
    trained.eval()
    with torch.no_grad():
        want = model(x).logits
        for program in (trained, still):
            for _ in range(2):
                torch.testing.assert_close(program(x).logits, want, **TOL)
        trained.train()
        assert not torch.allclose(trained(x).logits, want, **TOL)  # training mode drops again


def _eval_mode_models() -> list:
    x = torch.randint(0, 96, (3, 11))
    return [(gpt2("sdpa"), (x,)), (gpt2("sdpa").eval(), (x,))]


def test_eval_mode_never_drops():
    run_ranks(2, _eval_mode, captures=_eval_mode_models)


def test_the_plan_says_the_program_drops():
    model = gpt2()
    with pytest.warns(
        UserWarning,
        match=r"GPT2LMHeadModel drops in the sharded model .* 7 dropout op\(s\) "
        "captured in training mode",
    ):
        plan = autotp.plan(model, (torch.randint(0, 96, (2, 8)),), world_size=2)
    assert {"transformer.drop", "transformer.h.1.attn", "transformer.h.1.mlp.dropout"} <= set(plan.cost["dropout"])
    console = Console(width=200, record=True)
    print_plan(plan, console=console)
    assert "dropout: the program drops in 7 modules" in console.export_text()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = autotp.plan(model.eval(), (torch.randint(0, 96, (2, 8)),), world_size=2)
    assert quiet.cost["dropout"] == [] and model.training is False


# ---- the masks rank by rank, in one process -----------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("layout", [None, Shard(2), Shard(1), Shard(2, chunks=(24, 12, 12)), Shard(2, units=6)])
def test_reference_pieces_are_one_process_mask(layout, world):
    """Each rank's reference-mode mask is its piece of the mask one process draws, whatever the layout (fused
    blocks, uneven heads) and memory order (a transposed input); default mode draws pieces that differ."""
    x = torch.randn(3, 48, 5).transpose(1, 2)  # [3, 5, 48], dims 0, 2, 1 outermost first in memory
    torch.manual_seed(1)
    want = F.dropout(x, P, True)
    size = x.shape[layout.dim] if layout is not None else None
    pieces = []
    for rank in range(world):
        local = take_local(x, layout, rank, world) if layout is not None else x
        module = Dropout(P, layout, size, (0, 2, 1), rank, rank, world)
        module.reference = True
        torch.manual_seed(1)
        pieces.append(module(local))
        whole = take_local(want, layout, rank, world) if layout is not None else want
        torch.testing.assert_close(pieces[-1], whole, rtol=0, atol=0)
        module.reference = False
        torch.manual_seed(1)
        own = module(local)
        if layout is not None:
            assert not torch.equal(own == 0, pieces[-1] == 0)


@pytest.mark.parametrize("gqa", [False, True])
def test_reference_attention_heads_are_one_process_mask(gqa):
    """SDPA's dropout_p: each rank's heads of the keep-mask one process draws (math kernel), with a boolean
    mask; 6 heads at 4 ranks (2, 2, 1, 1), or grouped-query heads (6 query, 2 KV) at 2 ranks."""
    q = torch.randn(2, 7, 6, 8).transpose(1, 2)
    k, v = torch.randn(2, 2 if gqa else 6, 7, 8), torch.randn(2, 2 if gqa else 6, 7, 8)
    mask = torch.ones(7, 7, dtype=torch.bool).tril()[None, None].expand(2, 1, 7, 7)
    torch.manual_seed(2)
    want = F.scaled_dot_product_attention(q, k, v, mask, P, scale=0.3, enable_gqa=gqa)
    heads, world = (Shard(1), 2) if gqa else (Shard(1, units=6), 4)
    for rank in range(world):
        module = Attention(P, False, 0.3, gqa, 6, heads, rank, rank, world)
        module.reference = True
        torch.manual_seed(2)
        got = module(*(take_local(t, heads, rank, world) for t in (q, k, v)), mask)
        torch.testing.assert_close(got, take_local(want, heads, rank, world), **TOL)


def test_training_dropout_is_not_split_in_pieces_that_partly_overlap():
    """Ranks that share a unit draw its mask from one stream; pieces that only partly overlap (KV heads for
    query heads at 3 ranks: {0}, {0, 1}, {1}) cannot be drawn apart, and the rule does not offer them."""
    from autotp.ops.rules import separate_pieces

    assert separate_pieces(Shard(1, units=2), 2, 4)  # each KV head held by 2 ranks: the same piece
    assert not separate_pieces(Shard(1, units=2, of=8), 2, 3)
    assert all(separate_pieces(Shard(1), n, w) for n, w in itertools.product((5, 8), (2, 3, 4)))
