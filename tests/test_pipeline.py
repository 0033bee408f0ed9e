"""Pipeline stages (torch.distributed.pipelining) composed with autotp's TP and FSDP2: training equals one process."""

from __future__ import annotations

import datetime
import functools
import math
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.pipelining import ScheduleZBVZeroBubble

from autotp.tools.spawn import run_local
from tests.helpers import configs
from tests.helpers.distributed import run_unsupervised
from tests.helpers.exact import TOL
from tests.helpers.training import STEPS, VOCAB, adamw, batch, llama, token_loss, trained_in_one_process


def _train(
    rank: int,
    world: int,
    dims: tuple,
    names: tuple,
    schedule: str,
    stages,
    want: tuple,
    build=llama,
    virtual: int | None = None,
) -> dict:
    """Train on this rank's mesh slice and compare with one process: each step's loss on the last stage
    (mean over micro-batches, then over data-parallel replicas), every full parameter after the last step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import autotp
    import autotp.api
    from autotp.options import MeshOptions, PlanOptions, RunOptions
    from autotp.parallel.pipeline import pipeline

    mesh = init_device_mesh("cpu", dims, mesh_dim_names=names)

    def shard_stage(model, args, kwargs, graph, fixed):
        module = graph
        if "tp" in names:
            module = autotp.api.tensor_parallel(
                model, args, kwargs, PlanOptions(fixed=fixed), RunOptions(group=mesh["tp"].get_group()), graph=graph
            )
        return fully_shard(module, mesh=mesh["dp"]) if "dp" in names else module

    x, y = batch()
    if "dp" in names:  # each data-parallel rank trains on its own slice of the global batch
        dp, index = mesh["dp"].size(), mesh["dp"].get_local_rank()
        x, y = x.chunk(dp)[index], y.chunk(dp)[index]
    model = build()
    meshing = MeshOptions(loss_fn=token_loss, schedule=schedule, microbatches=4, stages=stages, virtual_stages=virtual)
    pipelined = pipeline(model, (x,), mesh=mesh, meshing=meshing, shard_stage=shard_stage)
    assert not any("forward" in vars(m) for m in model.modules())  # pipelining's split markers were removed
    names_here = [n for n, _ in pipelined.named_parameters()]
    assert names_here and all(n in dict(model.named_parameters()) for n in names_here), names_here
    optimizer, losses = adamw(pipelined.parameters()), []
    for _ in range(STEPS):
        per_microbatch = []
        pipelined.step(x, target=y, losses=per_microbatch)
        optimizer.step()
        optimizer.zero_grad()
        if per_microbatch:
            assert len(per_microbatch) == 4
            loss = torch.stack(per_microbatch).mean().detach()
            if "dp" in names:  # a replica's loss is its slice's mean; their mean is the global batch's
                dist.all_reduce(loss, group=mesh["dp"].get_group())
                loss /= mesh["dp"].size()
            losses.append(loss.item())
    want_losses, want_params = want
    if losses:  # the last stage
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), **TOL)
    params = pipelined.full_state_dict()
    assert set(params) == set(want_params)
    for name, value in want_params.items():
        torch.testing.assert_close(params[name], torch.from_numpy(value), **TOL, msg=name)
    saved = autotp.save_pretrained(pipelined, tempfile.mkdtemp())  # a collective; the mesh's first rank writes
    if dist.get_rank() == 0:
        on_disk = load_file(saved / "model.safetensors")
        assert on_disk.keys() == params.keys()
        for name, value in params.items():
            assert torch.equal(on_disk[name], value), name
    # forward only, against one process holding the same (trained) parameters
    if type(pipelined.schedule).__name__ in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        with pytest.raises(NotImplementedError, match="forward-only run of V-shaped schedules fails"):
            pipelined.evaluate(x, target=y, losses=[])
        return {"losses": losses, "starts": pipelined.starts}
    eval_losses = []
    evaluated = pipelined.evaluate(x, target=y, losses=eval_losses)
    if losses:
        reference = build()
        reference.load_state_dict(params, strict=False)  # every parameter (compared above); buffers as built
        with torch.no_grad():
            want = reference(x)
        torch.testing.assert_close(evaluated.logits, want.logits, **TOL)
        torch.testing.assert_close(torch.stack(eval_losses).mean(), token_loss(want, y), **TOL)
    else:
        assert evaluated is None
    return {"losses": losses, "starts": pipelined.starts}


def _run(world: int, *args) -> list:
    results = run_local(world, _train, *args, trained_in_one_process())
    assert sum(bool(r["losses"]) for r in results) == world // 2  # every rank of the last stage reported
    return results


@pytest.mark.slow
def test_tp2_pp2_1f1b_trains_like_one_process():
    """Stages from the cost model (embedding first, head and loss last), TP2 inside each, 4 micro-batches."""
    results = _run(4, (2, 2), ("pp", "tp"), "1f1b", None)
    assert len({tuple(r["starts"]) for r in results}) == 1


@pytest.mark.slow  # TP 2 x DP 2 x PP 2 training runs by default in test_mesh.py (from meta, the example's path)
def test_tp2_pp2_dp2_trains_like_one_process():
    """8 ranks: FSDP2 over data parallel on top of TP2 stages; each replica feeds half the global batch."""
    _run(8, (2, 2, 2), ("pp", "dp", "tp"), "1f1b", [0, 2])


def _pp2(rank: int, world: int, want: tuple, runs: list) -> None:
    """Pipeline only (2 ranks): each (schedule, stage starts) in ``runs`` trains like one process."""
    for schedule, starts in runs:
        _train(rank, world, (2,), ("pp",), schedule, starts, want)


def test_gpipe_and_interleaved_1f1b_train_like_one_process():
    """Interleaved 1F1B with two one-block stages per rank, by autotp's old name."""
    run_local(2, _pp2, trained_in_one_process(), [("gpipe", None), ("interleaved-1f1b", [0, 1, 2, 3])])


def test_zero_bubble_schedules_train_like_one_process():
    """PP 2, 4 micro-batches: the zero-bubble schedules split each backward into input and weight gradients; ZBV
    places stages in a V (rank 0 holds the first and the last), InterleavedZeroBubble in a loop, DualPipeV (a
    schedule name the README lists) in a V as ZBV does.  ZBV is given as a class with its stages (names resolve as
    test_schedules.py checks)."""
    run_local(
        2,
        _pp2,
        trained_in_one_process(),
        [("InterleavedZeroBubble", None), (ScheduleZBVZeroBubble, [0, 1, 2, 3]), ("DualPipeV", None)],
    )


def _four_per_rank(rank: int, world: int, want: tuple) -> None:
    _train(rank, world, (2,), ("pp",), "Interleaved1F1B", None, want, build=functools.partial(llama, 8), virtual=4)


@pytest.mark.slow
def test_interleaving_four_stages_per_rank_trains_like_one_process():
    """The planner proposes interleaving x 4: 8 one-block stages over 2 ranks (stages from the cost model)."""
    run_local(2, _four_per_rank, trained_in_one_process(functools.partial(llama, 8)))


@pytest.mark.slow  # ZBV: test_zero_bubble_schedules_...; TP x PP: test_tied_embeddings_..., test_mesh.py's meta 3-D
def test_tp2_pp2_zero_bubble_v_trains_like_one_process():
    """TP 2 inside each of 4 stages placed in a V (rank r holds stages r and 3 - r): autotp's collectives under
    the input/weight backward split."""
    results = _run(4, (2, 2), ("pp", "tp"), "ZBVZeroBubble", None)
    assert {tuple(r["starts"]) for r in results} == {(0, 1, 2, 3)}


def _stage_dies(rank: int, port: int, queue) -> None:
    """Rank 1 (the last stage) dies in its first forward; rank 0 reports how long it took to raise."""
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.options import MeshOptions
    from autotp.parallel.pipeline import pipeline

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    x, y = batch()
    meshing = MeshOptions(loss_fn=token_loss, microbatches=2, stages=[0, 2])
    pipelined = pipeline(llama(), (x,), mesh=mesh, meshing=meshing)
    if rank == 1:
        pipelined.modules[1].forward = lambda *args, **kwargs: os._exit(3)
    start = time.monotonic()
    try:
        pipelined.step(x, target=y, losses=[])
        queue.put(("no error", time.monotonic() - start))
    except Exception as exc:  # reported to the test, which checks it is the documented CollectiveError
        queue.put((f"{type(exc).__name__}: {exc}", time.monotonic() - start))
    queue.close()
    queue.join_thread()
    os._exit(0)


def test_a_dead_stage_makes_the_others_raise_in_time():
    """The last stage dies in its first forward: the first stage's send raises the CollectiveError
    reliability.md documents, naming its stages, the "pp" dimension and the peer stage's rank, within a minute."""
    [(message, seconds)] = run_unsupervised(2, _stage_dies, reports=1)
    assert message.startswith(
        "CollectiveError: autotp: a send or receive of pipeline stage(s) [0] over mesh "
        "dimension 'pp' (ranks [0, 1]) with stage 1 on rank 1 did not complete: "
        "a peer died"
    ), message
    assert seconds < 60, (message, seconds)


def _gpt2():
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    config = configs.gpt2(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=4,
        tie_word_embeddings=True,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


@pytest.mark.parametrize(
    "dims,names",
    [
        pytest.param((2,), ("pp",), marks=pytest.mark.slow),  # TP 2 x PP 2 has it
        ((2, 2), ("pp", "tp")),
    ],
)
def test_tied_embeddings_on_two_stages_train_like_one_process(dims, names):
    """GPT-2's tied input and output embeddings on PP 2 and TP 2 x PP 2: both end stages hold the weight and sum its
    gradient (Megatron's embedding group); 3 AdamW steps equal one process, and the weight is saved once (the
    file holds exactly the model's parameters, ``transformer.wte.weight`` and not ``lm_head.weight``)."""
    want = trained_in_one_process(_gpt2)
    assert "lm_head.weight" not in want[1]
    run_local(math.prod(dims), _train, dims, names, "1f1b", None, want, _gpt2)


def _tied_fixed(rank: int, world: int, want: tuple) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import autotp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    x, y = batch()
    model = _gpt2()
    pipelined = autotp.parallelize(
        model, (x,), mesh=mesh, loss_fn=token_loss, microbatches=4, fixed={"transformer.wte.weight": "S(1)"}
    )
    placed = {
        name: module.autotp_plan.params[name]
        for module in pipelined.modules.values()
        for name in ("transformer.wte.weight", "lm_head.weight")
        if name in module.autotp_plan.params
    }
    losses = []
    pipelined.step(x, target=y, losses=losses)
    if losses:
        torch.testing.assert_close(torch.stack(losses).mean().item(), want[0][0], **TOL)
    return placed


def test_a_users_placement_of_a_tied_weight_reaches_both_end_stages():
    """The user's plan options reach the choice of a tied weight's placement (the whole model's offers, read with
    those options): GPT-2's embedding, fixed hidden-split by its first name, is hidden-split on both end stages of
    PP 2 x TP 2, where its stages read it as ``lm_head.weight`` (with the default options' offers it took the
    vocabulary split; a string placement was not parsed), and the first step's loss is one process's."""
    want = trained_in_one_process(_gpt2)
    placed = run_local(4, _tied_fixed, want)
    assert all(placed) and {p for rank in placed for p in rank.values()} == {"S(1)"}, placed
