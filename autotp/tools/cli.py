"""The ``autotp`` command line: its arguments, parsed before anything heavy is imported (tools/commands.py runs
each command)."""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

from autotp.tools.cli_errors import OneLineParser, positive, run


def _figure_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--svg", default=None, help="also draw it as an SVG picture in this file")
    parser.add_argument("--html", default=None, help="also draw it in an HTML page in this file")


def _mesh_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--async-tp",
        choices=("auto", "on", "off"),
        default="off",
        help="price the all-gathers and reduce-scatters next to their matmuls fused (asynchronous TP under "
        "torch.compile): whichever prices better (auto), always, never",
    )
    parser.add_argument("--nodes", type=positive, default=None, help="a cluster of this many of the topology's nodes")
    parser.add_argument(
        "--global-batch",
        type=positive,
        default=None,
        help="samples per training step, split over data-parallel replicas and micro-batches (default: --batch)",
    )
    parser.add_argument(
        "--data-parallel",
        choices=("fsdp", "ddp"),
        default="fsdp",
        help="fsdp: parameters, gradients and optimizer state sharded; ddp: replicated",
    )
    parser.add_argument(
        "--expert-imbalance",
        type=float,
        default=1.0,
        help="routed experts: the busiest rank's rows over the uniform top-k share (default 1)",
    )
    parser.add_argument(
        "--overlap-all-to-all",
        type=float,
        default=0.0,
        help="routed experts: the share of all-to-all time hidden behind compute (0 to 1, default 0)",
    )


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help="package.module:factory returning (model, example_args), a Hugging Face config.json, or a model directory",
    )
    parser.add_argument("--topology", default=None, help="profile name (dgx-h100, 2x-dgx-h100, ...) or a .json path")
    parser.add_argument("--batch", type=positive, default=1, help="batch to price Hugging Face models at")
    parser.add_argument("--seq", type=positive, default=2048, help="sequence length to price Hugging Face models at")
    parser.add_argument("--inference", action="store_true", help="price a forward pass: no gradients or optimizer")
    parser.add_argument(
        "--memory-limit",
        type=float,
        default=None,
        help="GB per device a plan may use (default: 90%% of the topology's device memory)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="autotp", description="Automatic tensor parallelism for PyTorch")
    parser.add_argument("--debug", action="store_true", help="print the trace of an error, not just its line")
    parser.add_argument("--verbose", action="store_true", help="also print torch.export's notes on dims it fixed")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="plan a small LLaMA, run it sharded on 2 gloo processes, compare outputs")
    plan = sub.add_parser("plan", help="plan a model without any process group (built on the meta device)")
    _model_arguments(plan)
    plan.add_argument("--world-size", type=positive, required=True)
    plan.add_argument("--out", help="write the plan JSON here")
    plan.add_argument("--json", action="store_true", help="print the plan JSON instead of tables")
    plan.add_argument(
        "--devices", type=positive, default=None, help="also price every tp x pp x dp layout of this many devices"
    )
    _mesh_arguments(plan)
    plan.add_argument(
        "--no-fold",
        action="store_true",
        help="capture and solve every block (default: identical blocks planned from four)",
    )
    plan.add_argument("--all", action="store_true", help="one row per parameter (default: blocks placed alike folded)")
    _figure_arguments(plan)
    from autotp.tools.serve_report import add_serve_arguments

    add_serve_arguments(plan)
    plan.add_argument(
        "--sequence-parallel",
        choices=("auto", "on", "off"),
        default="auto",
        help="split norms, dropouts and residual adds by tokens: when memory demands it (auto), always, never",
    )
    plan.add_argument(
        "--experts",
        choices=("auto", "tensor", "parallel", "all-to-all"),
        default="auto",
        help="mixture-of-experts layers: every expert split (tensor), whole experts per rank computing "
        "their rows in place (parallel) or sent their rows by all-to-all (all-to-all), or whichever "
        "the cost model prices lower (auto)",
    )
    plan.add_argument(
        "--ep",
        type=positive,
        default=1,
        help="ranks of a mesh's expert-parallel dimension beyond the TP group (default 1: none)",
    )
    plan.add_argument(
        "--recompute",
        choices=("auto", "selective", "off"),
        default="auto",
        help="compute the attention cores again in the backward instead of keeping their scores: when "
        "memory demands it (auto), always, never",
    )
    mesh = sub.add_parser(
        "mesh",
        help="choose tensor x pipeline x data parallel sizes, micro-batches, schedule "
        "and stage boundaries for a number of devices",
    )
    _model_arguments(mesh)
    mesh.add_argument("--devices", type=positive, default=None, help="how many devices (default: all of the topology)")
    _mesh_arguments(mesh)
    mesh.add_argument("--json", action="store_true", help="print the choice and every candidate as JSON")
    _figure_arguments(mesh)
    show = sub.add_parser("show", help="print a saved plan")
    show.add_argument("plan")
    show.add_argument("--all", action="store_true", help="one row per parameter (default: blocks placed alike folded)")
    _figure_arguments(show)
    diff = sub.add_parser("diff", help="what changed between two plans, and the cost difference")
    diff.add_argument("a")
    diff.add_argument("b")
    explain = sub.add_parser("explain", help="the solver's alternatives for one op and their costs")
    explain.add_argument("plan")
    explain.add_argument(
        "node",
        help="a node name, module path or parameter name; 'experts': the expert strategies' estimated step times",
    )
    compare = sub.add_parser(
        "compare", help="price hand-written plans (transformers', Megatron's, DTensor's) beside autotp's"
    )
    _model_arguments(compare)
    compare.add_argument("--world-size", type=positive, required=True)
    from autotp.tools.compare import AGAINST

    compare.add_argument(
        "--against",
        nargs="+",
        choices=AGAINST,
        default=list(AGAINST),
        help="the hand-written plans to price (default: all that name this model's modules)",
    )
    cal = sub.add_parser("calibrate", help="measure collectives on this machine's process group, write a topology")
    cal.add_argument("--out", default="calibrated.json", help="where to write the topology profile")
    cal.add_argument("--nproc", type=positive, default=2, help="local gloo ranks to spawn when not under torchrun")
    from autotp.tools.serve import add_serve_parser

    add_serve_parser(sub, positive)
    argv = sys.argv[1:] if argv is None else argv
    args = run(parser.parse_args, argv, "--debug" in argv)
    if isinstance(args, int):  # a usage error, already said
        return args
    if args.verbose:  # export's own notes on dims it specialized pass too (autotp says what they mean either way)
        logging.getLogger("autotp").setLevel(logging.DEBUG)
    else:  # a plan is priced at the example's sizes; which sizes a program would run at is for parallelize's users
        warnings.filterwarnings("ignore", message="autotp: the example inputs fix")
    return run(_command(args.command), args, args.debug)


def _command(name: str):
    """The function that runs command ``name``, imported only once the arguments parsed (it may load torch)."""
    if name == "serve":
        from autotp.tools.serve import serve_command

        return serve_command
    from autotp.tools import commands

    return getattr(commands, f"{name}_command")


if __name__ == "__main__":
    sys.exit(main())
