"""Progress of long work (capturing, solving, a mesh search, a checkpoint load) for whoever shows it.

The library only marks its steps; nothing is shown unless a reporter is installed (``showing``): the command
line installs rich progress bars when stderr is a terminal, and none when it is piped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

_reporters: list = []  # the innermost ``showing`` last


class Reporter:
    """What a display implements: a step starts (with a total, or None for a spinner), advances, ends."""

    def start(self, description: str, total: int | None) -> object:
        raise NotImplementedError

    def advance(self, task: object, amount: int) -> None:
        raise NotImplementedError

    def end(self, task: object) -> None:
        raise NotImplementedError


class Advance(Protocol):
    """What ``step`` yields: ``advance(amount=1)``."""

    def __call__(self, amount: int = 1) -> None: ...


@contextlib.contextmanager
def showing(reporter: Reporter) -> Iterator[Reporter]:
    """Steps marked inside are shown by ``reporter``."""
    _reporters.append(reporter)
    try:
        yield reporter
    finally:
        _reporters.remove(reporter)


@contextlib.contextmanager
def step(description: str, total: int | None = None) -> Iterator[Advance]:
    """A step of long work; yields ``advance(amount=1)`` for steps of ``total`` parts."""
    if not _reporters:
        yield lambda amount=1: None
        return
    reporter = _reporters[-1]
    task = reporter.start(description, total)
    try:
        yield lambda amount=1: reporter.advance(task, amount)
    finally:
        reporter.end(task)
