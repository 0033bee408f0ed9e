"""Rich progress bars for the steps autotp marks (runtime/progress.py), drawn on a terminal only."""

from __future__ import annotations

import contextlib

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from autotp.runtime.progress import Reporter, showing


class Bars(Reporter):
    """One line a step: a spinner, its description, a bar and a count where it has parts, the time taken."""

    def __init__(self, console: Console):
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        )

    def start(self, description: str, total: int | None) -> object:
        return self.progress.add_task(description, total=total)

    def advance(self, task: object, amount: int) -> None:
        self.progress.advance(task, amount)

    def end(self, task: object) -> None:
        total = next(t.total for t in self.progress.tasks if t.id == task) or 1  # a spinner's step: done, 1 of 1
        self.progress.update(task, total=total, completed=total)


@contextlib.contextmanager
def progress_bars(console: Console):
    """Bars on ``console`` while the block runs, if it is a terminal; nothing at all when it is piped."""
    if not console.is_terminal:
        yield
        return
    bars = Bars(console)
    with bars.progress, showing(bars):
        yield
