"""The ``autotp`` command line: one small function per command."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import torch


def load_model(spec: str, batch: int, seq: int):
    """(model, example_args) on the meta device from ``package.module:factory``, a Hugging Face
    ``config.json`` or a model directory: no weights are read, so any size plans on a laptop."""
    path = Path(spec)
    if path.is_dir() or path.suffix == ".json":
        config_path = path / "config.json" if path.is_dir() else path
        if not config_path.exists():
            raise SystemExit(f"autotp: {config_path} does not exist")
        from transformers import AutoConfig, AutoModelForCausalLM
        config = AutoConfig.from_pretrained(str(config_path))
        config.use_cache = False
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return model, (torch.zeros(batch, seq, dtype=torch.long, device="meta"),)
    module, _, name = spec.partition(":")
    if not name:
        raise SystemExit(f"autotp: MODEL must be package.module:factory, a config.json or a model directory, "
                         f"got {spec!r}")
    sys.path.insert(0, os.getcwd())  # like `python -m`: modules of the current directory are importable
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"autotp: cannot load {spec!r}: {exc}") from exc
    with torch.device("meta"):
        return factory()


def _plan(args) -> int:
    import autotp

    from .report import print_plan, tensor_shapes
    model, example = load_model(args.model, args.batch, args.seq)
    result = autotp.plan(model, example, world_size=args.world_size, topology=args.topology,
                         training=not args.inference)
    if args.out:
        result.save(args.out)
    if args.json:
        print(result.to_json())
    else:
        print_plan(result, tensor_shapes(model))
    return 0


def _mesh(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .mesh import choose_mesh
    model, example = load_model(args.model, args.batch, args.seq)
    candidates = choose_mesh(model, example, devices=args.devices, topology=args.topology,
                             training=not args.inference)
    table = Table(title=f"mesh candidates on {args.topology or 'the default topology'}")
    for column in ("TP", "DP", "est. step ms", "memory/device GB", "note"):
        table.add_column(column)
    for c in candidates:
        table.add_row(str(c.tp), str(c.dp), "-" if c.seconds is None else f"{c.seconds * 1e3:.2f}",
                      "-" if c.memory is None else f"{c.memory / 1e9:.2f}", c.note)
    console = Console(width=140)
    console.print(table)
    best = candidates[0]
    console.print(f"best: TP {best.tp} x DP {best.dp}" if best.seconds is not None else "nothing fits")
    return 0 if best.seconds is not None else 1


def _demo(args) -> int:
    from .demo import main as demo
    return demo()


def _calibrate(args) -> int:
    from .calibrate_cli import main as calibrate
    return calibrate(args.out, args.nproc)


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="package.module:factory returning (model, example_args), a Hugging Face "
                                      "config.json, or a model directory")
    parser.add_argument("--topology", default=None, help="profile name (dgx-h100, 2x-dgx-h100, ...) or a .json path")
    parser.add_argument("--batch", type=int, default=1, help="batch to price Hugging Face models at")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length to price Hugging Face models at")
    parser.add_argument("--inference", action="store_true", help="price a forward pass: no gradients or optimizer")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autotp", description="Automatic tensor parallelism for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="plan a small LLaMA, run it sharded on 2 gloo processes, compare outputs")
    plan = sub.add_parser("plan", help="plan a model without any process group (built on the meta device)")
    _model_arguments(plan)
    plan.add_argument("--world-size", type=int, required=True)
    plan.add_argument("--out", help="write the plan JSON here")
    plan.add_argument("--json", action="store_true", help="print the plan JSON instead of tables")
    mesh = sub.add_parser("mesh", help="price every TP x DP split of a number of devices and pick the fastest")
    _model_arguments(mesh)
    mesh.add_argument("--devices", type=int, default=None, help="how many devices (default: all of the topology)")
    cal = sub.add_parser("calibrate", help="measure collectives on this machine's process group, write a topology")
    cal.add_argument("--out", default="calibrated.json", help="where to write the topology profile")
    cal.add_argument("--nproc", type=int, default=2, help="local gloo ranks to spawn when not under torchrun")
    args = parser.parse_args(argv)
    return {"plan": _plan, "mesh": _mesh, "demo": _demo, "calibrate": _calibrate}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
