"""A run's checkpoints in one directory: save every N steps, keep the newest K, resume from the newest complete one.

torchtitan's pattern on ``torch.distributed.checkpoint``: step ``N`` is written to ``step-N.partial`` and renamed
to ``step-N`` by the first rank once every rank has written its part, so a checkpoint a fault cut short is never
loaded (it keeps its temporary name, and the next save removes it).  A SIGTERM (a scheduler's preemption, torchrun
stopping its workers) is noted and acted on at the end of the step: every rank agrees, then saves and stops.

    checkpoints = RunCheckpoints(directory, every=100, keep=3)
    start = checkpoints.resume(model, optimizer, scheduler=scheduler)   # 0 when there is none
    for step in range(start, steps):
        ...
        if checkpoints.after(step, model, optimizer, scheduler=scheduler):
            break   # SIGTERM: saved, stop
"""

from __future__ import annotations

import re
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from autotp.runtime import progress
from autotp.runtime.dcp_checkpoint import checkpoint_state_dict, load_checkpoint_state_dict
from autotp.runtime.devices import device_of

_NAME = re.compile(r"step-(\d+)")


class RunCheckpoints:
    """``directory``'s checkpoints, one per saved step; ``every`` steps a save, the newest ``keep`` kept."""

    def __init__(self, directory, every: int, keep: int | None = None):
        if every < 1 or (keep is not None and keep < 1):
            raise ValueError(f"save every {every} steps, keep {keep}: both must be at least 1")
        self.directory, self.every, self.keep = Path(directory), every, keep
        self.stopping = False
        self._previous = signal.signal(signal.SIGTERM, self._note_stop)

    def _note_stop(self, signum, frame) -> None:
        self.stopping = True

    def complete(self) -> list[Path]:
        """The complete checkpoints, oldest first (a temporary name is never one)."""
        found = [(int(m.group(1)), p) for p in self.directory.glob("step-*") if (m := _NAME.fullmatch(p.name))]
        return [p for _, p in sorted(found)]

    def resume(self, module, optimizer=None, **run_state) -> int:
        """Load the newest complete checkpoint into the run: the number of steps it had done (0: none, start)."""
        found = self.complete()
        if not found:
            return 0
        state = checkpoint_state_dict(module, optimizer, step=0, **run_state)
        with progress.step(f"loading the checkpoint {found[-1].name}"):
            dcp.load(state, checkpoint_id=str(found[-1]))
            load_checkpoint_state_dict(module, state, optimizer, **run_state)
        return int(state["step"])

    def after(self, step: int, module, optimizer=None, **run_state) -> bool:
        """After step ``step`` (from 0): save when it is due or a SIGTERM came; whether the run should stop."""
        stop = self._agreed(self.stopping)
        if stop or (step + 1) % self.every == 0:
            self.save(step + 1, module, optimizer, **run_state)
        return stop

    def save(self, done: int, module, optimizer=None, **run_state) -> Path:
        """The checkpoint of a run that has done ``done`` steps (a collective): written under a temporary name,
        renamed by the first rank once all have written; older ones beyond ``keep`` removed."""
        final = self.directory / f"step-{done}"
        partial = final.with_name(final.name + ".partial")
        dcp.save(checkpoint_state_dict(module, optimizer, step=done, **run_state), checkpoint_id=str(partial))
        _barrier()
        if _first():
            shutil.rmtree(final, ignore_errors=True)  # a step saved again (after a restart): the new one
            partial.rename(final)
            for stale in self.directory.glob("step-*.partial"):
                shutil.rmtree(stale, ignore_errors=True)
            for old in self.complete()[: -self.keep] if self.keep else ():
                shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)

    @staticmethod
    def _agreed(mine: bool) -> bool:
        """Whether any rank was asked to stop (all ranks then save and stop together)."""
        if not dist.is_initialized():
            return mine
        flag = torch.tensor([float(mine)], device=device_of(dist.group.WORLD))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _first() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
