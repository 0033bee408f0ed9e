"""`autotp calibrate`: under torchrun it uses that process group; otherwise it spawns local gloo ranks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from autotp.tools.calibrate import calibrate, comparison
from autotp.tools.spawn import run_local


def _spawned(rank: int, world: int, out: str) -> None:
    calibrate(out)


def print_comparison(path: Path, console: Console) -> float:
    rows, median = comparison(path)
    table = Table(title=f"predicted vs measured on {path}, each size by the fit without it (held out)")
    for column in ("op", "bytes", "measured µs", "predicted µs", "error"):
        table.add_column(column, justify="right")
    for op, nbytes, measured, predicted, error in rows:
        table.add_row(op, str(nbytes), f"{measured * 1e6:.1f}", f"{predicted * 1e6:.1f}", f"{error:.0%}")
    console.print(table)
    console.print(f"median error on held-out sizes {median:.1%}")
    return median


def print_products(path: Path, console: Console) -> None:
    """The product fit judged on the sizes it was not fitted to (every fourth product held out)."""
    products = json.loads(Path(path).read_text())["products"]
    table = Table(title=f"products held out of the fit, {path}")
    for column in ("m", "n", "k", "measured of peak", "predicted", "error"):
        table.add_column(column, justify="right")
    for m, n, k, measured, predicted, error in products["held_out"]["every_fourth"]:
        table.add_row(str(m), str(n), str(k), f"{measured:.3f}", f"{predicted:.3f}", f"{error:.0%}")
    console.print(table)
    console.print(products["peak_fraction"]["source"])


def main(out: str, nproc: int) -> int:
    if "WORLD_SIZE" in os.environ:  # launched by torchrun: calibrate that group
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        written = calibrate(out)
        dist.destroy_process_group()
    else:
        run_local(nproc, _spawned, out, timeout=300)
        written = Path(out)
    if written is not None:
        print_comparison(Path(written), Console(width=120))
        print_products(Path(written), Console(width=120))
        print(f"wrote {written}: use it as --topology {written} or topology='{written}'")
    return 0
