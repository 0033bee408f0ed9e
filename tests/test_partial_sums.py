"""A partial sum plus a replicated operand (a bias, the residual stream) stays partial: one rank adds
the operand.  Parallel attention + MLP blocks with biases then run one forward all-reduce per block,
as bias-free ones do, and sequential ones two (Megatron).  Also: an encoder whose sequence length is
fixed by its config and does not divide the ranks (ViT, 17 tokens) runs exactly."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

import autotp
from autotp.placement import Shard
from autotp.runtime import transport
from tests.helpers.architectures import hf_model, same_as_unsharded
from tests.helpers.distributed import block_of, comm_counts, plan_ops, run_ranks
from tests.helpers.exact import TOL
from tests.helpers.models import SignedBranches, phi2, vit

BLOCKS = 1  # blocks are planned alike (tests/test_fold.py); one keeps the spawned ranks quick


def _collectives(step) -> dict:
    """The collectives ``step()`` runs by kind, counted by CommDebugMode (small all-reduces too: not one-shot)."""
    one_shot, transport.ONE_SHOT_BYTES = transport.ONE_SHOT_BYTES, 0
    try:
        with CommDebugMode() as comm:
            step()
    finally:
        transport.ONE_SHOT_BYTES = one_shot
    return plan_ops(comm_counts(comm))


def _per_block(plan, phase: str) -> list[int]:
    found = Counter(block_of(c["module"]) for c in plan.collectives if c["phase"] == phase and c["op"] == "all_reduce")
    return [found[b] for b in range(BLOCKS)]


def _block_cases(world: int) -> list:
    """(model, forward all-reduces per block, backward: one per layer norm feeding column-split matmuls)"""
    cases = [(hf_model("gpt_neox", num_hidden_layers=BLOCKS), 1, 2), (phi2(BLOCKS), 1, 1)]
    if world == 2:
        cases.append((hf_model("gpt_neox", num_hidden_layers=BLOCKS, use_parallel_residual=False), 2, 2))
    return cases


def _block_input() -> torch.Tensor:
    return torch.randint(0, 90, (2, 5), generator=torch.Generator().manual_seed(0))  # the same on every rank


def _blocks(rank: int, world: int) -> None:
    x = _block_input()
    for model, forward, backward in _block_cases(world):
        sharded = autotp.parallelize(model, (x,))
        plan = sharded.autotp_plan
        assert _per_block(plan, "forward") == [forward] * BLOCKS, plan.collectives
        assert _per_block(plan, "backward") == [backward] * BLOCKS, plan.collectives
        assert _collectives(lambda s=sharded: s(x)) == plan.collective_counts("forward")
        loss = sharded(x).logits.square().mean()
        assert _collectives(loss.backward) == plan.collective_counts("backward")
        model.zero_grad()
        sharded.zero_grad()
        same_as_unsharded(model, sharded)  # outputs and every gradient: biases' and the residual stream's


def _signed_model() -> tuple:
    torch.manual_seed(0)
    return SignedBranches().eval(), torch.randn(2, 5, 32)


def _signed(rank: int, world: int) -> None:
    model, x = _signed_model()
    sharded = autotp.parallelize(model, (x,))
    assert sharded.autotp_plan.params["a_out.weight"] == "S(1)", sharded.autotp_plan.params
    assert _collectives(lambda: sharded(x)) == {"all_reduce": 1}  # x - a + 0.5 b summed once, biases and x by rank 0
    same_as_unsharded(model, sharded, inputs=lambda batch, seq: torch.randn(batch, seq, 32))
    grad = torch.randn(2, 5, 32)
    inputs = [x.clone().requires_grad_() for _ in range(2)]
    sharded(inputs[0]).backward(grad)
    model(inputs[1]).backward(grad)
    torch.testing.assert_close(inputs[0].grad, inputs[1].grad, **TOL)  # the residual operand's gradient


def _pixels(batch: int, seq: int) -> torch.Tensor:
    return torch.randn(batch, 3, 16, 16)  # the sequence length is the model's: 16 patches + class token


def _vit(rank: int, world: int) -> None:
    model = vit(layers=BLOCKS)
    same_as_unsharded(model, autotp.parallelize(model, (_pixels(2, 0),)), inputs=_pixels)
    if world > 2:  # the position table split by tokens (6,6,5 or 5,4,4,4 of 17): the activations follow it
        model.zero_grad()
        table = "vit.embeddings.position_embeddings"
        sharded = autotp.parallelize(model, (_pixels(2, 0),), fixed={table: Shard(1, units=17)})
        assert dict(sharded.named_parameters())[table].shape[1] == (17 + world - 1 - rank) // world
        same_as_unsharded(model, sharded, inputs=_pixels)


def _models(world: int) -> list:
    """What ``_checks`` parallelizes at ``world`` ranks, in its order."""
    models = []
    if world != 3:
        models += [(model, (_block_input(),)) for model, _, _ in _block_cases(world)]
    if world == 2:
        model, x = _signed_model()
        models.append((model, (x,)))
    return [*models, (vit(layers=BLOCKS), (_pixels(2, 0),))]


def _checks(rank: int, world: int) -> None:
    """One spawn per world size: starting ranks costs more than the checks."""
    if world != 3:
        _blocks(rank, world)
    if world == 2:
        _signed(rank, world)
    _vit(rank, world)


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_partial_sums_and_static_sequences(world):
    """Blocks with biases (2, 4 ranks), sub and alpha (2 ranks), ViT (2, 3, 4 ranks): see the module docstring."""
    run_ranks(world, _checks, captures=functools.partial(_models, world))
