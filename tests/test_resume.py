"""Training state saved on one mesh resumes on another, pipelines included (issue 34): 2 AdamW steps on mesh A, a
``torch.distributed.checkpoint`` save, a resume on mesh B in the same processes, 2 more steps; the 4 steps' losses,
parameters and AdamW state equal 4 uninterrupted steps in one process.  The checkpoint also holds the step count,
the learning-rate scheduler (a warm-up, so its position matters), a data loader's position and the generators."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import autotp
from examples.train import Trainer, build, parse, schedule, train_whole
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL

TINY = ["--batch", "4", "--seq", "8", "--layers", "4", "--hidden", "32", "--vocab", "128", "--warmup", "3"]
SAVED, MORE = 2, 2
MESHES = {
    "PP 2 x TP 2": ["--pp", "2", "--tp", "2"],
    "TP 2 x DP 2": ["--tp", "2", "--dp", "2"],
    "PP 4": ["--pp", "4", "--tp", "1"],
    "interleaved PP 2 x 2": ["--pp", "2", "--tp", "2", "--schedule", "interleaved1f1b", "--microbatches", "4"],
    "TP 2 x DP 2 from meta": ["--tp", "2", "--dp", "2", "--meta"],
}


class Position:
    """A data loader's place in its data (``state_dict``/``load_state_dict``, as torchdata's StatefulDataLoader)."""

    def __init__(self):
        self.next = 0

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.next = state["next"]


def _steps(trainer: Trainer, data: Position, count: int) -> list[float]:
    losses = []
    for _ in range(count):
        losses.append(trainer.step(data.next))
        data.next += 1
    return losses


def _save_then_resume(rank: int, world: int, first: list, second: list | None, saved: str, final: str) -> list:
    trainer, data = Trainer(parse([*first, *TINY])), Position()
    losses = _steps(trainer, data, SAVED)
    dcp.save(
        autotp.checkpoint_state_dict(
            trainer.model, trainer.optimizer, scheduler=trainer.scheduler, data=data, step=SAVED
        ),
        checkpoint_id=saved,
    )
    generator = torch.get_rng_state()  # what dropout would draw its next masks from
    if second is None:  # resumed in one process, by the test
        return losses
    trainer, data = Trainer(parse([*second, *TINY])), Position()
    torch.manual_seed(1234)  # the resumed run must take the generators from the checkpoint
    state = autotp.checkpoint_state_dict(
        trainer.model, trainer.optimizer, scheduler=trainer.scheduler, data=data, step=0
    )
    dcp.load(state, checkpoint_id=saved)
    autotp.load_checkpoint_state_dict(trainer.model, state, trainer.optimizer, scheduler=trainer.scheduler, data=data)
    assert (state["step"], data.next, trainer.scheduler.last_epoch) == (SAVED, SAVED, SAVED)
    assert torch.equal(torch.get_rng_state(), generator)
    losses += _steps(trainer, data, MORE)
    dcp.save(autotp.checkpoint_state_dict(trainer.model, trainer.optimizer), checkpoint_id=final)
    return losses


def _one_process() -> tuple:
    """4 uninterrupted steps in one process: (losses, model, optimizer)."""
    o = parse(TINY)
    model = build(o)
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr)
    losses = train_whole(o, model, optimizer, range(SAVED + MORE), schedule(o, optimizer))
    return losses, model, optimizer


def _resumes(first: str, second: str | None, tmp_path) -> None:
    """Saved on ``first``, resumed on ``second`` (None: in this process); compared with one process."""
    saved, final = str(tmp_path / "saved"), str(tmp_path / "final")
    losses = run_ranks(4, _save_then_resume, MESHES[first], second and MESHES[second], saved, final)[0]
    o = parse(TINY)
    read = build(o)
    read_optimizer = torch.optim.AdamW(read.parameters(), lr=o.lr)
    scheduler, data = schedule(o, read_optimizer), Position()
    run_state = {"scheduler": scheduler, "data": data} if second is None else {}  # ``final`` holds no run state
    state = autotp.checkpoint_state_dict(read, read_optimizer, **run_state, **({"step": 0} if run_state else {}))
    dcp.load(state, checkpoint_id=saved if second is None else final)
    autotp.load_checkpoint_state_dict(read, state, read_optimizer, **run_state)
    if second is None:
        assert (state["step"], data.next, scheduler.last_epoch) == (SAVED, SAVED, SAVED)
        losses += train_whole(o, read, read_optimizer, range(SAVED, SAVED + MORE), scheduler)
    want_losses, model, optimizer = _one_process()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), **TOL)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(read.state_dict()[name], value, **TOL, msg=name)
    names = dict(zip((p for p in model.parameters()), (n for n, _ in model.named_parameters()), strict=True))
    read_params = dict(read.named_parameters())
    for param, want in optimizer.state.items():
        got = read_optimizer.state[read_params[names[param]]]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(got[key], want[key], **TOL, msg=f"{names[param]} {key}")


@pytest.mark.parametrize(
    "first, second",
    [
        ("PP 2 x TP 2", "TP 2 x DP 2"),
        pytest.param("TP 2 x DP 2", "PP 2 x TP 2", marks=pytest.mark.slow),  # the default tier moves it one way
    ],
)
def test_training_state_moves_between_pipeline_and_data_parallel_meshes(first, second, tmp_path):
    _resumes(first, second, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "first, second", [("PP 2 x TP 2", "PP 4"), ("interleaved PP 2 x 2", None), ("PP 2 x TP 2", "TP 2 x DP 2 from meta")]
)
def test_training_state_moves_to_other_stage_cuts_one_process_and_a_meta_model(first, second, tmp_path):
    _resumes(first, second, tmp_path)
