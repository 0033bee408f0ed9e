"""A run restarts after a fault and loses nothing (issue 34): examples/train.py under ``torchrun --max-restarts 1``
with ``--save-dir``; the test kills one rank from outside (SIGKILL, by pid) while it is held at a known point
(tests/helpers/held_train.py), torchrun restarts the group, and the run resumes from the newest complete checkpoint.
The printed loss curve and the last checkpoint's parameters equal one process's uninterrupted training."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import autotp
from examples.train import build, parse, reference
from tests.helpers.exact import TOL

ROOT = Path(__file__).resolve().parents[1]
ARGS = [
    "--tp",
    "2",
    "--steps",
    "6",
    "--batch",
    "4",
    "--seq",
    "8",
    "--layers",
    "2",
    "--hidden",
    "32",
    "--vocab",
    "128",
    "--warmup",
    "3",
    "--save-every",
    "2",
]


def _run(tmp_path: Path, hold: str, extra: list = ()) -> tuple[str, int]:
    """torchrun of tests.helpers.held_train (a module, from the root) with rank 1 held at ``hold``, killed there:
    (what it printed, its exit code)."""
    held = tmp_path / "held"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "AUTOTP_HOLD": hold,
        "AUTOTP_HOLD_FILE": str(held),
        "PYTHONPATH": str(ROOT),
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.2",
        "-m",
        "tests.helpers.held_train",
        *ARGS,
        "--save-dir",
        str(tmp_path / "run"),
        *extra,
    ]
    log = tmp_path / "printed"
    with (
        log.open("w") as out,
        subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT
        ) as run,
    ):
        deadline = time.monotonic() + 300
        while not held.exists() or not held.read_text():
            assert run.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        os.kill(int(held.read_text()), signal.SIGKILL)
        run.wait(timeout=300)
    return log.read_text(), run.returncode


def _losses(printed: str) -> dict:
    """step -> the loss rank 0 printed for it, the last time it ran the step."""
    return {int(s): float(v) for s, v in re.findall(r"step\s+(\d+)\s+loss (\S+)", printed)}


def _same_as_one_process(printed: str, tmp_path: Path) -> None:
    o = parse(ARGS)
    model, want = reference(o)
    got = _losses(printed)
    assert sorted(got) == list(range(1, 7)), printed
    torch.testing.assert_close(
        torch.tensor([got[s] for s in range(1, 7)]), torch.tensor(want), rtol=1e-4, atol=2e-6
    )  # printed to 6 decimals
    read = build(o)
    state = autotp.checkpoint_state_dict(read)
    dcp.load(state, checkpoint_id=str(tmp_path / "run" / "step-6"))
    autotp.load_checkpoint_state_dict(read, state)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(read.state_dict()[name], value, **TOL, msg=name)


def test_a_rank_killed_after_step_3_restarts_from_step_2(tmp_path):
    printed, code = _run(tmp_path, "after-step:3")
    assert code == 0, printed
    assert f"resumed from {tmp_path / 'run' / 'step-2'}: 2 steps done" in printed, printed
    _same_as_one_process(printed, tmp_path)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-2", "step-4", "step-6"]


@pytest.mark.slow
def test_a_rank_killed_while_saving_restarts_from_the_previous_checkpoint(tmp_path):
    """Killed after writing step 4's files, before the completion mark: step 4 is never loaded, and is saved
    again; ``--keep 2`` leaves the newest two."""
    printed, code = _run(tmp_path, "in-save:4", ["--keep", "2"])
    assert code == 0, printed
    assert f"resumed from {tmp_path / 'run' / 'step-2'}: 2 steps done" in printed, printed
    _same_as_one_process(printed, tmp_path)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-4", "step-6"]
