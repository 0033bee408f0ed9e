"""examples/train.py as torchrun runs it, with one rank held still at a point the restart tests name, so that the
test can kill it there from outside (SIGKILL, by the pid this writes to ``AUTOTP_HOLD_FILE``).  Only the first
attempt holds (torchrun's restart count 0); the restarted group runs examples/train.py unchanged.

    AUTOTP_HOLD=after-step:3   rank 1 stops after its 3rd step
    AUTOTP_HOLD=in-save:4      rank 1 stops inside the save of step 4, after writing, before the completion mark
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import examples.train as train
from autotp.runtime import run_checkpoints


def _hold() -> None:
    Path(os.environ["AUTOTP_HOLD_FILE"]).write_text(str(os.getpid()))
    time.sleep(600)  # killed by the test


def main() -> None:
    where, _, at = os.environ.get("AUTOTP_HOLD", "").partition(":")
    held = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and os.environ.get("RANK") == "1"
    if held and where == "after-step":
        step = train.Trainer.step

        def step_then_hold(self, index):
            loss = step(self, index)
            if index + 1 == int(at):
                _hold()
            return loss

        train.Trainer.step = step_then_hold
    if held and where == "in-save":
        save = run_checkpoints.dcp.save

        def save_then_hold(state, checkpoint_id):
            save(state, checkpoint_id=checkpoint_id)
            if Path(checkpoint_id).name == f"step-{at}.partial":
                _hold()

        run_checkpoints.dcp.save = save_then_hold
    train.main()


if __name__ == "__main__":
    main()
