"""torch.distributed.checkpoint: model and optimizer state saved from TP 2 x DP 2 (FSDP2) load into TP 4
(no mesh: all ranks) and into one process, and training continues with the losses of uninterrupted training."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

import autotp
from autotp.placement import Shard
from autotp.runtime.dcp_checkpoint import _dtensor_placements, _Layout
from examples.train import Trainer, build, global_batch, parse, reference, train_whole
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL

# 4 query heads sharing 2 KV heads: at TP 4 each KV head is held by two ranks (no DTensor placement)
TINY = ["--batch", "4", "--seq", "8", "--layers", "2", "--hidden", "32", "--vocab", "128"]
SAVED, MORE = 3, 2  # steps before the checkpoint, steps after


def _resume(o, model: torch.nn.Module, directory: str) -> list[float]:
    """Load model and AdamW state into a fresh ``model`` (the initial weights), then train on: the losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr)
    state = autotp.checkpoint_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=directory)
    autotp.load_checkpoint_state_dict(model, state, optimizer)
    return train_whole(o, model, optimizer, range(SAVED, SAVED + MORE))


def _save_then_load(rank: int, world: int, directory: str) -> list[float]:
    first = Trainer(parse(["--tp", "2", "--dp", "2", *TINY]))
    for step in range(SAVED):
        first.step(step)
    dcp.save(autotp.checkpoint_state_dict(first.model, first.optimizer), checkpoint_id=directory)
    o = parse(TINY)  # TP 4 without a mesh: autotp.parallelize over all ranks
    return _resume(o, autotp.parallelize(build(o), (global_batch(o, 0)[0],)), directory)


def _models() -> list:
    """What the ranks capture: the model on a DP replica's half batch (TP 2 x DP 2), then on the whole (TP 4)."""
    o = parse(TINY)
    x = global_batch(o, 0)[0]
    return [(build(o), (x.chunk(2)[0],)), (build(o), (x,))]


def test_a_checkpoint_from_tp2_x_dp2_resumes_on_tp4_and_in_one_process(tmp_path):
    o = parse(["--steps", str(SAVED + MORE), *TINY])
    expected = torch.tensor(reference(o)[1][SAVED:])
    resumed = run_ranks(4, _save_then_load, str(tmp_path), captures=_models)
    # saved sharded, not gathered: each block weight in one piece per rank (TP 2 x FSDP 2), Adam's state too
    metadata = dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
    chunks = {name: len(entry.chunks) for name, entry in metadata.items() if hasattr(entry, "chunks")}
    for kind in ("model", "optim.state"):
        for weight in ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight"):
            suffix = ".exp_avg" if kind == "optim.state" else ""
            assert chunks[f"{kind}.model.layers.1.{weight}{suffix}"] == 4, chunks
    torch.testing.assert_close(torch.tensor(resumed[0]), expected, **TOL)
    torch.testing.assert_close(torch.tensor(_resume(o, build(o), str(tmp_path))), expected, **TOL)


class _Mesh:
    """What the layout check reads of a (dp 2, tp 4) DeviceMesh."""

    mesh_dim_names, shape = ("dp", "tp"), (2, 4)

    def __getitem__(self, dim):
        return SimpleNamespace(size=lambda: dict(zip(self.mesh_dim_names, self.shape, strict=True))[dim])


@pytest.mark.parametrize(
    ("shard", "dtensor"),
    [
        (None, True),
        (Shard(0), True),
        (Shard(1), True),
        (Shard(0, units=10), False),  # 10 heads on 4 ranks: 3, 3, 2, 2 (DTensor's chunks are 3, 3, 3, 1)
        (Shard(0, chunks=(40, 20, 20)), False),  # fused [q|k|v]: every rank holds three pieces
        (Shard(0, units=2), False),  # 2 KV heads on 4 ranks: each held by two ranks
    ],
)
def test_only_layouts_dtensor_describes_are_saved_as_dtensors(shard, dtensor):
    """Anything else is gathered and saved whole, never put at a wrong offset."""
    for fsdp in (False, True):
        layout = _Layout(shard, (80, 32), fsdp)
        assert (_dtensor_placements(_Mesh(), layout) is not None) == dtensor, (shard, fsdp)
