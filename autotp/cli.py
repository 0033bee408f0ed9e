"""The ``autotp`` command line."""
from __future__ import annotations

import argparse
import importlib
import os
import sys


def _load_factory(spec: str):
    """``package.module:function`` returning (model, example_args)."""
    module, _, name = spec.partition(":")
    if not name:
        raise SystemExit(f"autotp: MODEL must look like package.module:factory, got {spec!r}")
    sys.path.insert(0, os.getcwd())  # like `python -m`: modules of the current directory are importable
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"autotp: cannot load {spec!r}: {exc}") from exc
    return factory()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autotp", description="Automatic tensor parallelism for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="plan a small LLaMA, run it sharded on 2 gloo processes, compare outputs")
    plan = sub.add_parser("plan", help="plan a model without any process group")
    plan.add_argument("model", help="package.module:factory returning (model, example_args)")
    plan.add_argument("--world-size", type=int, required=True)
    plan.add_argument("--topology", default=None)
    plan.add_argument("--out", help="write the plan JSON here")
    plan.add_argument("--json", action="store_true", help="print the plan JSON instead of tables")
    cal = sub.add_parser("calibrate", help="measure collectives on this machine's process group, write a topology")
    cal.add_argument("--out", default="calibrated.json", help="where to write the topology profile")
    cal.add_argument("--nproc", type=int, default=2, help="local gloo ranks to spawn when not under torchrun")
    args = parser.parse_args(argv)

    if args.command == "calibrate":
        from .calibrate_cli import main as calibrate
        return calibrate(args.out, args.nproc)

    if args.command == "demo":
        from .demo import main as demo
        return demo()
    import autotp

    from .report import print_plan, tensor_shapes
    model, example = _load_factory(args.model)
    result = autotp.plan(model, example, world_size=args.world_size, topology=args.topology)
    if args.out:
        result.save(args.out)
    if args.json:
        print(result.to_json())
    else:
        print_plan(result, tensor_shapes(model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
