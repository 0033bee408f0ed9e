"""A run's checkpoint directory (autotp/runtime/run_checkpoints.py), in one process: a save every N steps under a
temporary name renamed when written, the newest K kept, a cut-short checkpoint never loaded, resume from the newest
complete one with the model, AdamW, the scheduler and the step, and a SIGTERM that saves and stops the run."""

from __future__ import annotations

import os
import signal

import torch

from autotp.runtime.run_checkpoints import RunCheckpoints
from examples.train import build, parse, schedule, train_whole
from tests.helpers.exact import TOL

TINY = parse(["--batch", "2", "--seq", "8", "--layers", "1", "--hidden", "32", "--vocab", "64", "--warmup", "3"])


def _run(directory, steps: int, keep=None, stop_after=None) -> tuple:
    """Train to ``steps`` from the directory's newest checkpoint: (model, losses by step, the steps it started at)."""
    model = build(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=TINY.lr)
    scheduler = schedule(TINY, optimizer)
    saves = RunCheckpoints(directory, every=2, keep=keep)
    first, losses = saves.resume(model, optimizer, scheduler=scheduler), {}
    try:
        for step in range(first, steps):
            losses[step] = train_whole(TINY, model, optimizer, [step], scheduler)[0]
            if step + 1 == stop_after:
                os.kill(os.getpid(), signal.SIGTERM)  # noted, acted on at the end of the step
            if saves.after(step, model, optimizer, scheduler=scheduler):
                break
    finally:
        saves.close()
    return model, losses, first


def test_resumes_from_the_newest_complete_checkpoint(tmp_path):
    whole, want, _ = _run(tmp_path / "uninterrupted", 6)
    _, before, _ = _run(tmp_path / "run", 4, keep=2)
    (tmp_path / "run" / "step-6.partial").mkdir()  # a save cut short: never loaded
    model, after, first = _run(tmp_path / "run", 6, keep=2)
    assert first == 4 and sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-4", "step-6"]
    torch.testing.assert_close(
        torch.tensor([*before.values(), *after.values()]), torch.tensor(list(want.values())), **TOL
    )
    for name, value in whole.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, **TOL, msg=name)


def test_a_sigterm_saves_at_the_end_of_the_step_and_stops(tmp_path):
    _, losses, _ = _run(tmp_path, 6, stop_after=3)
    assert sorted(losses) == [0, 1, 2] and sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-3"]
    _, rest, first = _run(tmp_path, 6)
    assert first == 3 and sorted(rest) == [3, 4, 5]


def test_a_resume_shows_its_load_on_a_terminal(tmp_path):
    """Loading a checkpoint is long work at scale: a rich bar says which one (issue 34), on a terminal only."""
    import io

    from rich.console import Console

    from autotp.tools.progress_bars import progress_bars

    _run(tmp_path, 2)
    shown = io.StringIO()
    with progress_bars(Console(file=shown, force_terminal=True, width=120)):
        _, _, first = _run(tmp_path, 2)
    assert first == 2 and "loading the checkpoint step-2" in shown.getvalue(), shown.getvalue()
