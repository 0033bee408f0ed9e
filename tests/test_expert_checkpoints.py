"""Checkpoints under expert parallelism by all-to-all (issue 25 item 5): a rank reads only its own experts from
transformers' per-expert files, from fused [E, ...] tables and from DCP; DCP state written with whole experts
per rank loads into expert tensor parallelism (each expert split), into one process, and back."""

from __future__ import annotations

import functools

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import autotp
from autotp.runtime.hf_checkpoint import Checkpoint
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL
from tests.helpers.moe import expert_params, mixtral, pretrained, with_default_inputs


def _reads_own_experts(rank: int, world: int, per_expert: str, fused: str) -> None:
    read = []
    original = Checkpoint._read_stored

    def spy(self, key, box):
        read.append((key, box))
        return original(self, key, box)

    Checkpoint._read_stored = spy
    model = mixtral(layers=1)
    first, count = 2 * rank, 2  # 4 experts on 2 ranks
    for directory in (per_expert, fused):
        read.clear()
        sharded = autotp.from_pretrained(directory, experts="all-to-all")
        experts = [(key, box) for key, box in read if ".experts." in key]
        if directory == per_expert:  # experts.E.w1/w2/w3: only this rank's E are opened
            held = {int(key.split(".experts.")[1].split(".")[0]) for key, _ in experts}
            assert held == set(range(first, first + count)), experts
        else:  # fused tables: only this rank's rows of dim 0
            assert experts and all(box[0] == slice(first, first + count) for _, box in experts), experts
        x = torch.randint(0, 96, (2, 5))
        torch.testing.assert_close(sharded(x).logits, model(x).logits, **TOL)
    Checkpoint._read_stored = original


def _own_experts_models(*directories: str) -> list:
    return with_default_inputs([pretrained(directory) for directory in directories])


def test_an_expert_parallel_rank_reads_only_its_experts(tmp_path):
    model = mixtral(layers=1)
    model.save_pretrained(tmp_path / "per-expert")  # transformers' layout: experts one by one
    (tmp_path / "fused").mkdir()
    save_file(
        {n: t.contiguous() for n, t in model.state_dict().items()},
        tmp_path / "fused" / "model.safetensors",
        metadata={"format": "pt"},
    )
    model.config.save_pretrained(tmp_path / "fused")
    directories = str(tmp_path / "per-expert"), str(tmp_path / "fused")
    run_ranks(2, _reads_own_experts, *directories, captures=functools.partial(_own_experts_models, *directories))


def _batch() -> tuple:
    return (torch.randint(0, 96, (2, 5)),)


def _reshard_models() -> list:
    """What each rank parallelizes: a trained Mixtral (on a batch) and the one it loads into (default inputs)."""
    return [(mixtral(layers=1), _batch()), *with_default_inputs([mixtral(layers=1)])]


def _trained(experts: str | None, mesh=None):
    """A Mixtral whose weights moved one SGD step from the initial ones (so a load that kept them fails)."""
    model = mixtral(layers=1)
    sharded = autotp.parallelize(model, _batch(), mesh=mesh, experts=experts)
    optimizer = torch.optim.SGD(sharded.parameters(), lr=0.5)
    torch.manual_seed(3)
    sharded(torch.randint(0, 96, (2, 5))).logits.square().mean().backward()
    optimizer.step()
    return sharded


def _reshard(rank: int, world: int, directory: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    saved = {}
    for name, experts, mesh, into in (
        ("tp-a2a", "all-to-all", None, "tensor"),
        ("tp-tensor", "tensor", None, "all-to-all"),
        ("ep", None, ("ep",), "tensor"),
    ):
        first = _trained(experts, mesh and init_device_mesh("cpu", (world,), mesh_dim_names=mesh))
        assert {first.autotp_plan.params[p][0] for p in expert_params(first.autotp_source)} == (
            {"S"} if experts == "tensor" else {"A"}
        ), first.autotp_plan.params
        saved[name] = autotp.full_state_dict(first)
        dcp.save(autotp.checkpoint_state_dict(first), checkpoint_id=f"{directory}/{name}")
        second = autotp.parallelize(mixtral(layers=1), experts=into)
        state = autotp.checkpoint_state_dict(second)
        dcp.load(state, checkpoint_id=f"{directory}/{name}")
        autotp.load_checkpoint_state_dict(second, state)
        loaded = autotp.full_state_dict(second)
        for param, value in saved[name].items():
            torch.testing.assert_close(
                loaded[param], value, rtol=0, atol=0, msg=lambda m, p=param, n=name: f"{n} {p}: {m}"
            )
    if rank == 0:  # tensors through a file: a queue would share their memory with a process about to exit
        torch.save(saved, f"{directory}/saved.pt")


def test_dcp_state_reshards_between_expert_parallelism_and_expert_tensor_parallelism(tmp_path):
    run_ranks(2, _reshard, str(tmp_path), captures=_reshard_models)
    saved = torch.load(tmp_path / "saved.pt")
    # whole experts over the TP group are DTensor pieces (a loading rank reads its own); into one process too
    metadata = dcp.FileSystemReader(str(tmp_path / "tp-a2a")).read_metadata().state_dict_metadata
    assert len(metadata["model.model.layers.0.mlp.experts.gate_up_proj"].chunks) == 2, metadata
    for name, state in saved.items():
        model = mixtral(layers=1)
        loaded = autotp.checkpoint_state_dict(model)
        dcp.load(loaded, checkpoint_id=str(tmp_path / name))
        autotp.load_checkpoint_state_dict(model, loaded)
        for param, value in state.items():
            torch.testing.assert_close(model.get_parameter(param).detach(), value, rtol=0, atol=0)
