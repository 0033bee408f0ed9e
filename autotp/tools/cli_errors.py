"""Errors of the command line (and of anything else that fronts autotp, such as a server) in one line: what is
wrong and what to do, and an exit status by kind; ``--debug`` shows the trace instead."""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

# Exit statuses: nothing fits (docs/cli.md), a usage error (argparse's), an error inside autotp
NOTHING_FITS, USAGE, INTERNAL = 1, 2, 3
AUTOTP_DIR = Path(__file__).resolve().parents[1]  # where autotp is installed, not any folder named autotp


class UsageError(Exception):
    """An argument that cannot work, found before any capture: ``what`` is wrong, ``fix`` says what to do."""

    def __init__(self, what: str, fix: str):
        super().__init__(f"{what}; {fix}")


class OneLineParser(argparse.ArgumentParser):
    """argparse whose mistakes are one line (usage, then the error, by default): autotp: <error>; see --help."""

    def error(self, message: str):
        raise UsageError(message, f"see {self.prog} --help")


def positive(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def status_and_line(exc: BaseException) -> tuple[int, str]:
    """The exit status and the one line ``exc`` is reported as (a usage error without loading torch)."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if isinstance(exc, (UsageError, FileNotFoundError)):
        return USAGE, f"autotp: {first}"
    from autotp.passes.capture import CaptureError
    from autotp.planning.solution import DoesNotFit, PlanningError

    if isinstance(exc, DoesNotFit):
        return NOTHING_FITS, f"autotp: {first}"
    if isinstance(exc, (PlanningError, CaptureError)):
        return NOTHING_FITS, f"autotp: {first}; rerun with --debug for the trace"
    if isinstance(exc, (ValueError, TypeError)) and _raised_by_autotp_check(exc):
        return USAGE, f"autotp: {first}"
    return INTERNAL, (
        f"autotp: internal error ({type(exc).__name__}: {first}); rerun with --debug for the trace and report it"
    )


def _raised_by_autotp_check(exc: BaseException) -> bool:
    """A ValueError autotp raises on purpose checks a value it was given (options, topologies, plans); one from
    deeper in torch or a library is autotp's failure, reported as internal."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(AUTOTP_DIR)


def run(command, args, debug: bool) -> int:
    """``command(args)``'s exit status; an exception printed as one line on stderr (its trace with ``debug``)."""
    try:
        return command(args)
    except KeyboardInterrupt:
        print("autotp: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # every error a user can meet ends here, as one line
        if debug:
            traceback.print_exc()
        status, line = status_and_line(exc)
        print(line, file=sys.stderr)
        return status
