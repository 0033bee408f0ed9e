"""TP x DP over a DeviceMesh: training equals one process; full state and save_pretrained from the mesh;
a dead DP rank makes the others raise.  Runs through examples/train.py, the code users launch."""

from __future__ import annotations

import datetime
import functools
import os
import re
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autotp
from autotp.parallel.mesh import mesh_dims
from autotp.tools.spawn import run_local
from examples import mlp
from examples.train import build, global_batch, parse, reference, train
from tests.helpers.distributed import run_ranks, run_unsupervised
from tests.helpers.exact import TOL

# a LLaMA of 2 layers, hidden 32, 4 query heads sharing 2 KV heads; a global batch of 4 x 8 tokens
TINY = ["--steps", "3", "--batch", "4", "--seq", "8", "--layers", "2", "--hidden", "32", "--vocab", "128"]


def _check_training(o):
    """3 AdamW steps: the losses and the full parameters after the last step equal one process's."""
    trainer, losses = train(o, display=False)
    model, expected = reference(o)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), **TOL)
    full = autotp.full_state_dict(trainer.model)
    assert full.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), **TOL, msg=lambda m, n=name: f"{n}: {m}")
    return trainer


def _gathered_per_block(model: torch.nn.Module, x: torch.Tensor, layers: int) -> list:
    """For each block's forward, as it starts: the blocks whose parameters are gathered (FSDP2 swaps a unit's
    sharded DTensors for whole tensors while it is unsharded)."""
    blocks, seen = [model.get_submodule(f"model.layers.{i}") for i in range(layers)], []

    def gathered():
        return [i for i, b in enumerate(blocks) if not any(isinstance(p, DTensor) for p in b.parameters())]

    hooks = [b.register_forward_pre_hook(lambda m, a, i=i: seen.append((i, gathered()))) for i, b in enumerate(blocks)]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return seen


def _fsdp_units_are_blocks(trainer) -> None:
    """FSDP2 units per block (torchtitan's layout): each block's parameters are gathered for its own forward only."""
    layers = trainer.o.layers
    assert trainer.model.autotp_units == [f"model.layers.{i}" for i in range(layers)]
    assert {n for n, _ in trainer.model.named_parameters()} == {n for n, _ in build(trainer.o).named_parameters()}
    x = global_batch(trainer.o, 0)[0][:1]
    assert _gathered_per_block(trainer.model, x, layers) == [(i, [i]) for i in range(layers)]


def _replica_batch(o) -> torch.Tensor:
    """A DP replica's half of the first global batch (what the trainer's model is captured with)."""
    return global_batch(o, 0)[0].chunk(2)[0]


def _trainer_models(argv: list, meta: bool = False) -> list:
    o = parse(argv)
    return [(build(o, meta=meta), (_replica_batch(o),))]


def _mlp():
    torch.manual_seed(0)
    return mlp.build()


def _tp_dp_models() -> list:
    model, args = _mlp()
    return [*_trainer_models(["--tp", "2", "--dp", "2", *TINY]), (model, args)]


def _tp_dp(rank: int, world: int, directory: str) -> None:
    trainer = _check_training(parse(["--tp", "2", "--dp", "2", "--data-parallel", "fsdp", *TINY]))
    assert {type(p).__name__ for p in trainer.model.parameters()} == {"DTensor"}  # FSDP2 holds them
    _fsdp_units_are_blocks(trainer)
    autotp.save_pretrained(trainer.model, directory)
    _check_training(parse(["--tp", "2", "--dp", "2", "--data-parallel", "ddp", *TINY]))
    # a mesh without "tp": FSDP2 alone over 4 replicas, each with the whole model
    model, (x,) = _mlp()
    replicated = autotp.parallelize(model, (x,), mesh=init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))
    torch.testing.assert_close(replicated(x), model(x), **TOL)


def test_tp2_x_dp2_trains_like_one_process(tmp_path):
    run_ranks(4, _tp_dp, str(tmp_path), captures=_tp_dp_models)
    # one writer, one copy: the saved file holds the trained full parameters
    model, _ = reference(parse(TINY))
    saved = load_file(tmp_path / "model.safetensors")
    assert saved.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        torch.testing.assert_close(saved[name], p.detach(), **TOL)


def _dp(rank: int, world: int) -> None:
    _fsdp_units_are_blocks(_check_training(parse(["--tp", "1", "--dp", "2", *TINY])))


def test_dp2_with_fsdp_units_per_block_trains_like_one_process():
    run_ranks(2, _dp, captures=functools.partial(_trainer_models, ["--tp", "1", "--dp", "2", *TINY]))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return (x @ self.weight).relu()


class _Reader(torch.nn.Module):
    """Three blocks; ``early``: the root reads the last block's weight before any block runs."""

    def __init__(self, early: bool):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block() for _ in range(3))
        self.early = early

    def forward(self, x):
        s = self.layers[2].weight.sum() if self.early else 0
        for layer in self.layers:
            x = layer(x)
        return x + s


def test_a_block_the_root_reads_early_stays_in_the_root_unit_and_says_so():
    from autotp.parallel.blocks import block_units

    assert block_units(torch.fx.symbolic_trace(_Reader(False)), "layers") == ["layers.0", "layers.1", "layers.2"]
    with pytest.warns(UserWarning, match=r"1 of 3 blocks stay in the root unit \(layers\.2\)"):
        assert block_units(torch.fx.symbolic_trace(_Reader(True)), "layers") == ["layers.0", "layers.1"]


# TP 2 x DP 2 x PP 2 (1F1B, the default micro-batch count: one per stage), 2 steps on a global batch of 8
# (4 sequences per replica, micro-batches of 2)
EIGHT = ["--tp", "2", "--dp", "2", "--pp", "2", *TINY, "--steps", "2", "--batch", "8"]


def _example(rank: int, world: int) -> list[float]:
    return train(parse(EIGHT), display=False)[1]


@pytest.mark.slow
def test_the_training_example_on_8_ranks():
    """examples/train.py's code path on 8 local gloo ranks."""
    losses = run_local(8, _example)[0]
    expected = reference(parse(EIGHT))[1]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), **TOL)


def _from_meta(rank: int, world: int, directory: str, saved: str) -> None:
    import torch.distributed.checkpoint as dcp

    # safetensors, piece by piece (with "pp": test_meta_tp2_x_dp2_x_pp2_from_a_checkpoint_trains_like_one_process)
    _check_training(parse(["--tp", "2", "--dp", "2", *TINY, "--meta", "--checkpoint", directory]))
    trainer = _check_training(parse(["--tp", "2", "--dp", "2", *TINY, "--meta"]))  # the seeded initialisation
    dcp.save(autotp.checkpoint_state_dict(trainer.model), checkpoint_id=saved)
    trained = autotp.full_state_dict(trainer.model)
    o = parse(["--tp", "2", "--dp", "2", *TINY])
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = global_batch(o, 0)[0].chunk(2)[mesh["dp"].get_local_rank()]
    loaded = autotp.parallelize(build(o, meta=True), (x,), mesh=mesh, checkpoint=saved)  # a DCP directory
    left = autotp.parallelize(build(o, meta=True), (x,), mesh=mesh)  # torchtitan's idiom: on meta until filled
    assert all(p.is_meta for p in left.parameters())
    autotp.materialize(left)
    dcp.load(state := autotp.checkpoint_state_dict(left), checkpoint_id=saved)
    autotp.load_checkpoint_state_dict(left, state)
    for module in (loaded, left):
        full = autotp.full_state_dict(module)
        assert full.keys() == trained.keys()
        assert all(torch.equal(full[name], value) for name, value in trained.items())


def test_meta_models_load_their_pieces_and_train_like_one_process(tmp_path):
    """TP 2 x DP 2 (FSDP2) built on meta from a safetensors checkpoint, and initialised per rank: losses and
    parameters equal one process's; the trained model saved with torch.distributed.checkpoint and read back into a
    meta model (checkpoint=DIR, and materialize + dcp.load)."""
    build(parse(TINY)).save_pretrained(tmp_path / "hf")
    run_ranks(
        4,
        _from_meta,
        str(tmp_path / "hf"),
        str(tmp_path / "dcp"),
        captures=functools.partial(_trainer_models, ["--tp", "2", "--dp", "2", *TINY], meta=True),
    )


def _eight_from_meta(rank: int, world: int, directory: str) -> None:
    _check_training(parse([*EIGHT, "--meta", "--checkpoint", directory]))


def test_meta_tp2_x_dp2_x_pp2_from_a_checkpoint_trains_like_one_process(tmp_path):
    build(parse(TINY)).save_pretrained(tmp_path)
    run_local(8, _eight_from_meta, str(tmp_path))


# PP 2 with the default micro-batch count: 2 micro-batches of 2 sequences, sliced from a view (tokens[:, :-1]) as a
# training loop's inputs usually are
SMALL = ["--tp", "1", "--pp", "2", *TINY, "--steps", "2"]


def _small(rank: int, world: int) -> list[float]:
    return train(parse(SMALL), display=False)[1]


def test_default_microbatches_train_like_one_process():
    losses = run_local(2, _small)[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference(parse(SMALL))[1]), **TOL)


def test_meshes_name_their_dimensions():
    assert mesh_dims(SimpleNamespace(mesh_dim_names=("dp", "tp"), ndim=2)) == ("dp", "tp")
    assert mesh_dims(SimpleNamespace(mesh_dim_names=("pp", "dp", "tp"), ndim=3)) == ("pp", "dp", "tp")
    for names in [("tp", "dp"), ("dp", "x"), None, ("tp", "tp")]:
        with pytest.raises(ValueError, match="name them from"):
            mesh_dims(SimpleNamespace(mesh_dim_names=names, ndim=2))
    model, args = mlp.build()
    with pytest.raises(ValueError, match="needs loss_fn"):
        autotp.parallelize(model, args, mesh=SimpleNamespace(mesh_dim_names=("pp", "tp"), ndim=2))
    with pytest.raises(ValueError, match="data_parallel='zero'"):
        autotp.parallelize(model, args, mesh=SimpleNamespace(mesh_dim_names=("dp", "tp"), ndim=2), data_parallel="zero")


def _victim(rank: int, port: int, queue) -> None:
    """TP 2 x DP 2 with FSDP2 (an MLP: no transformers to import); rank 3 dies after the first step, the
    others report how they ended."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE="4")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(0)
    model, (x,) = mlp.build()
    sharded = autotp.parallelize(model, (x,), mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    optimizer = torch.optim.SGD(sharded.parameters(), lr=0.1)

    def step():
        sharded(x).square().mean().backward()
        optimizer.step()

    _second_step(rank, step, queue, lambda: os._exit(3))
    queue.close()
    queue.join_thread()
    os._exit(0)


def _second_step(rank: int, step, queue, stop) -> None:
    """One step, then rank 3 stops (``stop()``) and the others report how their second step ended."""
    step()
    if rank == 3:
        stop()
    start = time.monotonic()
    try:
        step()
        queue.put((rank, "no error", time.monotonic() - start))
    except Exception as exc:
        queue.put((rank, f"{type(exc).__name__}: {exc}", time.monotonic() - start))


DIED = "did not complete: another rank died, is stuck, or runs different code (look at the other ranks' output)"


def test_a_dead_dp_rank_makes_the_others_raise():
    """Rank 3 of TP 2 x DP 2 dies: each survivor raises the CollectiveError reliability.md documents, naming the
    collective and its mesh dimension: rank 1 (its "dp" peer) FSDP's all-gather, rank 2 (its "tp" peer) the TP
    all-reduce, rank 0 whichever collective its peers, leaving, end."""
    reports = {rank: (message, seconds) for rank, message, seconds in run_unsupervised(4, _victim, reports=3)}
    assert sorted(reports) == [0, 1, 2]
    for rank, (message, seconds) in reports.items():
        assert message.startswith("CollectiveError: autotp: ") and DIED in message, (rank, message)
        assert seconds < 60, (rank, message, seconds)  # the process group's timeout is 300 s
    assert "FSDP all_gather over mesh dimension 'dp' (ranks [1, 3]) of the parameters" in reports[1][0], reports[1]
    assert "all_reduce over mesh dimension 'tp' (ranks [2, 3]) of torch.float32" in reports[2][0], reports[2]
    assert any(f"over mesh dimension {dim}" in reports[0][0] for dim in ("'tp' (ranks [0, 1])", "'dp' (ranks [0, 2])"))


class _Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class _Blocks(torch.nn.Module):
    """Four identical residual blocks and a head: pipeline stages and FSDP units without transformers."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Residual() for _ in range(4))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _stops(dims: tuple, names: tuple, rank: int, port: int, queue) -> None:
    """Rank 3 stops (alive, stuck) after one training step; the others report how their second step ended.
    The process group's timeout is 300 s; parallelize's is 8 s."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE="4", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(0)
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    mesh = init_device_mesh("cpu", dims, mesh_dim_names=names)
    pipelined = "pp" in names
    options = {"loss_fn": torch.nn.functional.mse_loss, "microbatches": 2} if pipelined else {}
    model = autotp.parallelize(_Blocks(), (x,), mesh=mesh, timeout=8, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        if pipelined:
            model.step(x, target=y, losses=[])
        else:
            torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    _second_step(rank, step, queue, lambda: time.sleep(600))  # stuck: ended by the test
    time.sleep(600)  # its peers may still be waiting on it: ended by the test


@pytest.mark.parametrize("dims, names, dim", [((2, 2), ("dp", "tp"), "dp"), ((2, 2), ("pp", "dp"), "pp")])
def test_a_stopped_rank_makes_the_others_raise_within_parallelizes_timeout(dims, names, dim):
    """Rank 3 stops: its peer in each dimension raises a CollectiveError naming that dimension within
    parallelize's 8 s, not the process group's 300 s (nor DeviceMesh's 30-minute default) — rank 1, its "dp" peer,
    in FSDP's all-gather or its "pp" peer in a receive from stage 1; rank 2, its "tp" peer, in a TP collective —
    and the others fail through that peer or directly, as late as two timeouts (slack for a loaded machine)."""
    reports = {
        r: (message, seconds)
        for r, message, seconds in run_unsupervised(4, functools.partial(_stops, dims, names), reports=3, end=True)
    }
    assert sorted(reports) == [0, 1, 2]
    for rank, (message, seconds) in reports.items():
        assert message.startswith("CollectiveError") and "mesh dimension" in message, (rank, message)
        assert seconds < 60, (rank, message, seconds)
    message, seconds = reports[1]
    assert f"mesh dimension {dim!r} (ranks [1, 3])" in message, message
    assert 7 < seconds, (message, seconds)  # it waited for the stuck rank: the timeout, not a closed connection
    if dim == "dp":
        assert "FSDP all_gather" in message and "parameters" in message, message
        message, seconds = reports[2]
        assert re.search(
            r"(all_reduce|reduce_scatter|all_gather) over mesh dimension 'tp' \(ranks \[2, 3\]\) of "
            r"torch.float32 .* for \w+ \(aten\.",
            message,
        ), message  # one of the plan's TP collectives
        assert 7 < seconds, (message, seconds)
    else:
        assert "pipeline stage(s) [0]" in message and "stage 1 on rank 3" in message, message


def test_full_state_dict_of_a_pipeline_asks_the_pipeline():
    """A pipeline (a mesh with "pp") is not a module: it gathers its stages itself."""
    pipeline = SimpleNamespace(full_state_dict=lambda: {"w": torch.ones(2)})
    assert autotp.full_state_dict(pipeline)["w"].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="takes a module"):
        autotp.full_state_dict(pipeline, grads=True)
