"""One graph under every option: ``torch.compile(sharded, fullgraph=True)`` with inductor on the CPU compiles
the sharded program without a break and trains exactly as one process does, over 3 steps, on 2 gloo ranks
(4 for meshes): sequence parallelism, selective and full recomputation, dropout, FSDP2 units compiled per block,
pipeline stages compiled each (every expert strategy: tests/test_compiled_experts.py).  Compiles are slow on
the CPU: the default tier runs sequence parallelism, the other options are in the slow tier."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import autotp
from autotp.runtime.dropout import Attention, Dropout, random_ops
from tests.helpers import configs, training
from tests.helpers.compiled import STEPS, compiled_training_matches
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL, logits
from tests.helpers.models import llama_with
from tests.helpers.sequence_parallel import regather_limits


def _tokens() -> tuple:
    return (torch.randint(0, 96, (2, 8)),)


def _model() -> torch.nn.Module:
    return llama_with(heads=4, kv=2, head_dim=8, layers=1)


def _sequence_parallel(rank: int, world: int, recompute: str | bool, limit: float | None = None) -> None:
    """A 1-block LLaMA with its tokens split between the TP regions; ``recompute``: "selective" (autotp's
    recomputed attention cores), "full" (the whole program under torch.utils.checkpoint, as a trainer wraps
    each block) or False; ``limit``: a memory limit under which one gathered token tensor is kept as this rank's
    piece (a gather marked must-recompute) and the other whole (a plain gather)."""
    model = _model()
    selective = recompute if recompute == "selective" else False
    bounded = {"memory_limit": limit} if limit else {}
    sharded = autotp.parallelize(model, _tokens(), sequence_parallel=True, recompute=selective, **bounded)
    if limit:
        gathered = {entry["regather"] for entry in sharded.autotp_plan.nodes.values() if "regather" in entry}
        assert gathered == {False, True}, sharded.autotp_plan.nodes
    assert any(c["op"] == "reduce_scatter" for c in sharded.autotp_plan.collectives)
    assert bool(sharded.autotp_plan.cost["recompute"]) == bool(selective)
    run = (lambda x: checkpoint(sharded, x, use_reentrant=False)) if recompute == "full" else None
    torch.manual_seed(1)
    compiled_training_matches(model, sharded, _tokens, run)


def test_sequence_parallel_compiles_as_one_graph_and_trains_exactly():
    whole, pieces = regather_limits(_model(), _tokens())
    run_ranks(2, _sequence_parallel, False, (whole + pieces) / 2)


@pytest.mark.slow  # the default tier compiles sequence parallelism above
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_compiles_as_one_graph_and_trains_exactly(recompute):
    run_ranks(2, _sequence_parallel, recompute)


def _gpt2_dropping():
    """A 1-block GPT-2 dropping everywhere: embeddings, residual branches, SDPA's dropout_p."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    config = configs.gpt2(n_layer=1, bos_token_id=0, eos_token_id=0, attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1)
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config).train()


def _step(run, sharded, x, seed: int) -> tuple:
    """(output, ``sharded``'s gradients by name) of one forward and backward of ``run`` (``sharded`` or its
    compiled form) with every mask drawn after ``seed``."""
    torch.manual_seed(seed)
    out = logits(run(x))
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in sharded.named_parameters()}


def _dropout(rank: int, world: int) -> None:
    import torch.distributed as dist
    from torch._inductor import config as inductor

    x = torch.randint(0, 96, (2, 8))
    sharded = autotp.parallelize(_gpt2_dropping(), (x,), sequence_parallel=True, recompute="selective")
    assert sharded.autotp_plan.cost["recompute"]
    dropouts = random_ops(sharded)
    assert any(isinstance(m, Attention) and m.layout is not None for m in dropouts)
    assert any(isinstance(m, Dropout) and m.layout is not None for m in dropouts)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.5)
    with inductor.patch(fallback_random=True):  # inductor draws as eager does: the compiled masks are eager's
        compiled = torch.compile(sharded, fullgraph=True)
        for step in range(STEPS):
            eager = _step(sharded, sharded, x, seed=step)
            opt.zero_grad()
            out, grads = _step(compiled, sharded, x, seed=step)
            torch.testing.assert_close(out, eager[0], **TOL)
            for name, grad in grads.items():
                torch.testing.assert_close(grad, eager[1][name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
            opt.step()
            opt.zero_grad()
        for m in dropouts:  # each compiled alone: a split input's mask differs across ranks, a whole one's does not
            if isinstance(m, Dropout):
                torch.manual_seed(5)
                mask = torch.compile(m, fullgraph=True)(torch.ones(2, 4, 64)) == 0
                masks = [None] * world
                dist.all_gather_object(masks, mask)
                assert torch.equal(masks[0], masks[1]) == (m.layout is None), m


@pytest.mark.slow  # the default tier compiles sequence parallelism above
def test_dropout_compiles_drawing_eagers_masks_apart_on_split_inputs_and_again_when_recomputed():
    run_ranks(2, _dropout)


@pytest.mark.slow  # the default tier compiles sequence parallelism above
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_fsdp2_units_compiled_per_block_train_exactly(sequence_parallel):
    reference = training.trained_in_one_process(lambda: training.llama(layers=2))
    run_ranks(4, training.tp_dp_matches, reference, sequence_parallel, True)


def _pipeline_stages(rank: int, world: int, reference: tuple) -> int:
    """PP 2 x TP 2, 2 micro-batches (1F1B): each stage's program compiled as one graph; every step's loss (the last
    stage) and the trained parameters equal one process's."""
    from torch.distributed.device_mesh import init_device_mesh

    losses, params = reference
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    x, y = training.batch()
    pipelined = autotp.parallelize(training.llama(), (x,), mesh=mesh, loss_fn=training.token_loss, microbatches=2)
    for stage in pipelined.modules.values():
        stage.compile(fullgraph=True)
    optimizer, found = training.adamw(pipelined.parameters()), []
    for _ in range(training.STEPS):
        per_microbatch: list = []
        pipelined.step(x, target=y, losses=per_microbatch)
        optimizer.step()
        optimizer.zero_grad()
        found += [torch.stack(per_microbatch).mean().item()] if per_microbatch else []
    if found:  # the last stage
        torch.testing.assert_close(torch.tensor(found), torch.tensor(losses), **TOL)
    trained = pipelined.full_state_dict()
    for name, value in params.items():
        torch.testing.assert_close(trained[name], torch.from_numpy(value), **TOL, msg=name)
    return len(found)


@pytest.mark.slow  # the default tier compiles sequence parallelism above
def test_pipeline_stages_compile_as_one_graph_each_and_train_exactly():
    assert run_ranks(4, _pipeline_stages, training.trained_in_one_process()) == [0, 0, training.STEPS, training.STEPS]
