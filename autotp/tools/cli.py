"""The ``autotp`` command line: one small function per command."""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import warnings
from pathlib import Path

import torch

from autotp.tools.cli_errors import OneLineParser, UsageError, positive, run
from autotp.tools.progress_bars import progress_bars


def load_model(spec: str, batch: int, seq: int):
    """(model, example_args) on the meta device from ``package.module:factory``, a Hugging Face
    ``config.json`` or a model directory: no weights are read, so any size plans on a laptop."""
    path = Path(spec)
    if path.is_dir() or path.suffix == ".json":
        config_path = path / "config.json" if path.is_dir() else path
        if not config_path.exists():
            raise UsageError(f"{config_path} does not exist", "give a config.json, a model directory holding one, "
                             "or package.module:factory")
        from transformers import AutoConfig, AutoModelForCausalLM
        config = AutoConfig.from_pretrained(str(config_path))
        config.use_cache = False
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return model, (torch.zeros(batch, seq, dtype=torch.long, device="meta"),)
    module, _, name = spec.partition(":")
    if not name:
        raise UsageError(f"MODEL must be package.module:factory, a config.json or a model directory, got {spec!r}",
                         "see autotp plan --help")
    sys.path.insert(0, os.getcwd())  # like `python -m`: modules of the current directory are importable
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"cannot load {spec!r} ({exc})", "run from the directory that holds the module, or give "
                         "its full package path") from exc
    with torch.device("meta"):
        return factory()


def _console():
    from rich.console import Console
    return Console(width=140, stderr=True)


def _checked(args) -> None:
    """The arguments a capture would need, checked before it (which takes seconds to minutes)."""
    from autotp.cost_models import load_topology
    topology = load_topology(args.topology, getattr(args, "nodes", None))  # a name it does not know: one line
    for flag in ("world_size", "devices"):
        wanted = getattr(args, flag, None)
        if wanted is not None and wanted > topology.devices:
            raise UsageError(f"--{flag.replace('_', '-')} {wanted} is more than topology {topology.name} has "
                             f"({topology.devices} devices)", "pick a topology with more devices (e.g. "
                             "2x-dgx-h100), --nodes N, or fewer ranks")
    if args.memory_limit is not None and not args.memory_limit > 0:
        raise UsageError(f"--memory-limit must be a positive number of GB, got {args.memory_limit}",
                         "give GB per device, e.g. --memory-limit 70")


def _plan(args) -> int:
    import autotp
    from autotp.tools.report import print_plan, tensor_shapes
    _checked(args)
    if args.serve:
        from autotp.tools.serve_report import print_serving
        with progress_bars(_console()):
            return print_serving(args, lambda: load_model(args.model, args.batch, args.seq))
    with progress_bars(_console()):
        model, example = load_model(args.model, args.batch, args.seq)
        if args.inference:
            model.eval()  # no dropout: a model in training mode drops (and keeps its masks)
        result = autotp.plan(model, example, world_size=args.world_size, topology=args.topology,
                             training=not args.inference, fold=not args.no_fold,
                             sequence_parallel={"auto": None, "on": True, "off": False}[args.sequence_parallel],
                             recompute={"auto": None, "selective": "selective", "off": False}[args.recompute],
                             experts=None if args.experts == "auto" else args.experts, ep=args.ep,
                             memory_limit=_limit(args))
    if args.out:
        result.save(args.out)
    _figures(args, "plan", result)
    if args.json:
        print(result.to_json())
        return 0
    print_plan(result, tensor_shapes(model), every=args.all)
    return _print_mesh(model, example, args) if args.devices else 0


def _figures(args, kind: str, result) -> None:
    """``--svg`` / ``--html``: the plan's middle block, or the mesh planner's layouts, as a picture."""
    if not (getattr(args, "svg", None) or getattr(args, "html", None)):
        return
    from autotp.tools.figures import html_page, mesh_svg, plan_svg
    svg = plan_svg(result) if kind == "plan" else mesh_svg(result)
    if args.svg:
        Path(args.svg).write_text(svg)
    if args.html:
        title = f"autotp {kind}: {getattr(args, 'model', None) or getattr(args, 'plan', '')}"
        Path(args.html).write_text(html_page(title, svg, "Estimates of autotp's cost model."))


def _figure_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--svg", default=None, help="also draw it as an SVG picture in this file")
    parser.add_argument("--html", default=None, help="also draw it in an HTML page in this file")


def _limit(args) -> float | None:
    return args.memory_limit * 1e9 if args.memory_limit is not None else None


def _mesh(args) -> int:
    _checked(args)
    with progress_bars(_console()):
        model, example = load_model(args.model, args.batch, args.seq)
    return _print_mesh(model, example, args)


def _print_mesh(model, example, args) -> int:
    """Price every tp x pp x dp layout of ``args.devices``; exit status 1 when nothing fits."""
    from rich.console import Console

    from autotp.planning.mesh_search import plan_mesh
    from autotp.planning.solve import PlanningError
    from autotp.tools.report import mesh_table
    with progress_bars(_console()):
        try:
            result = plan_mesh(model, example, devices=args.devices, topology=args.topology, nodes=args.nodes,
                               global_batch=args.global_batch or args.batch, training=not args.inference,
                               data_parallel=args.data_parallel, memory_limit=_limit(args),
                               expert_imbalance=args.expert_imbalance, overlap_all_to_all=args.overlap_all_to_all)
        except (PlanningError, ValueError) as exc:
            print(f"autotp: {exc}", file=sys.stderr)
            return 1
    if getattr(args, "command", "") == "mesh":
        _figures(args, "mesh", result)
    if args.json:
        print(result.to_json())
        return 0
    for part in mesh_table(result):
        Console(width=140).print(part)
    return 0


def _mesh_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=positive, default=None, help="a cluster of this many of the topology's nodes")
    parser.add_argument("--global-batch", type=positive, default=None,
                        help="samples per training step, split over data-parallel replicas and micro-batches "
                             "(default: --batch)")
    parser.add_argument("--data-parallel", choices=("fsdp", "ddp"), default="fsdp",
                        help="fsdp: parameters, gradients and optimizer state sharded; ddp: replicated")
    parser.add_argument("--expert-imbalance", type=float, default=1.0,
                        help="routed experts: the busiest rank's rows over the uniform top-k share (default 1)")
    parser.add_argument("--overlap-all-to-all", type=float, default=0.0,
                        help="routed experts: the share of all-to-all time hidden behind compute (0 to 1, default 0)")


def _load_plan(path: str):
    from autotp.plan import Plan, PlanMismatch
    try:
        return Plan.load(path)
    except OSError as exc:
        raise UsageError(f"cannot read {path} ({exc.strerror or exc})", "give a plan file written by autotp plan "
                         "--out") from exc
    except (PlanMismatch, ValueError) as exc:
        raise UsageError(f"{path}: {str(exc).splitlines()[0]}",
                         "give a plan file written by autotp plan --out") from exc


def _show(args) -> int:
    from autotp.tools.report import print_plan
    plan = _load_plan(args.plan)
    _figures(args, "plan", plan)
    print_plan(plan, every=args.all)
    return 0


def _diff(args) -> int:
    from rich.console import Console

    from autotp.tools.report import diff_tables
    console = Console(width=140)
    for part in diff_tables(_load_plan(args.a), _load_plan(args.b)):
        console.print(part)
    return 0


def _explain(args) -> int:
    from rich.console import Console

    from autotp.tools.report import explain_table
    try:
        Console(width=160).print(explain_table(_load_plan(args.plan), args.node))
    except KeyError as exc:
        raise UsageError(str(exc.args[0]), "autotp show PLAN lists the parameters and ops it names") from exc
    return 0


def _compare(args) -> int:
    from rich.console import Console

    from autotp.tools.compare import compare
    from autotp.tools.report import compare_table
    _checked(args)
    with progress_bars(_console()):
        model, example = load_model(args.model, args.batch, args.seq)
        result = compare(model, example, world_size=args.world_size, topology=args.topology,
                         training=not args.inference, memory_limit=_limit(args), against=args.against)
    if result["hf_invalid"] and "hf" in args.against:
        print(f"{type(model).__name__}: Hugging Face's tp_plan is not valid here: {result['hf_invalid']}")
    labels = {"hf": "HF tp_plan", "megatron": "Megatron", "megatron-sp": "Megatron + SP", "dtensor": "DTensor"}
    plans = {labels[name]: result[name] for name in args.against if result.get(name)}
    plans.update({"HF ep_plan": result["hf_ep"]} if result.get("hf_ep") else {})
    invalid = [name for name in args.against if result.get(name) is False and name != "hf"]
    if invalid:
        print(f"{', '.join(invalid)}: the plan's even splits cut whole heads or other units at TP {args.world_size}, "
              "so no exact program runs it")
    missing = [name for name in args.against if name not in result]
    if missing:
        print(f"no {', '.join(missing)} plan names modules of {type(model).__name__} "
              f"(autotp/tools/hand_plans.json lists their patterns)")
    if not plans:
        print(f"autotp's plan: {result['autotp']['seconds'] * 1e6:.1f} µs per step (estimated); nothing to compare")
        return 1
    title = (f"{type(model).__name__} at TP {args.world_size}: hand-written plans vs autotp, each priced as it runs "
             "(one cost model)")
    plans["autotp"] = result["autotp"]
    Console(width=160).print(compare_table(plans, title))
    for name, priced in plans.items():
        if priced.get("unpriced"):
            print(f"{name}: collectives of styles {', '.join(priced['unpriced'])} not counted (unknown to autotp)")
    return 0


def _demo(args) -> int:
    from autotp.tools.demo import main as demo
    return demo()


def _calibrate(args) -> int:
    from autotp.tools.calibrate_cli import main as calibrate
    return calibrate(args.out, args.nproc)


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="package.module:factory returning (model, example_args), a Hugging Face "
                                      "config.json, or a model directory")
    parser.add_argument("--topology", default=None, help="profile name (dgx-h100, 2x-dgx-h100, ...) or a .json path")
    parser.add_argument("--batch", type=positive, default=1, help="batch to price Hugging Face models at")
    parser.add_argument("--seq", type=positive, default=2048, help="sequence length to price Hugging Face models at")
    parser.add_argument("--inference", action="store_true", help="price a forward pass: no gradients or optimizer")
    parser.add_argument("--memory-limit", type=float, default=None,
                        help="GB per device a plan may use (default: 90%% of the topology's device memory)")


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
    plan.add_argument("--devices", type=positive, default=None,
                      help="also price every tp x pp x dp layout of this many devices")
    _mesh_arguments(plan)
    plan.add_argument("--no-fold", action="store_true",
                      help="capture and solve every block (default: identical blocks planned from four)")
    plan.add_argument("--all", action="store_true", help="one row per parameter (default: blocks placed alike folded)")
    _figure_arguments(plan)
    from autotp.tools.serve_report import add_serve_arguments
    add_serve_arguments(plan)
    plan.add_argument("--sequence-parallel", choices=("auto", "on", "off"), default="auto",
                      help="split norms, dropouts and residual adds by tokens: when memory demands it (auto), always, "
                           "never")
    plan.add_argument("--experts", choices=("auto", "tensor", "parallel", "all-to-all"), default="auto",
                      help="mixture-of-experts layers: every expert split (tensor), whole experts per rank computing "
                           "their rows in place (parallel) or sent their rows by all-to-all (all-to-all), or whichever "
                           "the cost model prices lower (auto)")
    plan.add_argument("--ep", type=positive, default=1,
                      help="ranks of a mesh's expert-parallel dimension beyond the TP group (default 1: none)")
    plan.add_argument("--recompute", choices=("auto", "selective", "off"), default="auto",
                      help="compute the attention cores again in the backward instead of keeping their scores: when "
                           "memory demands it (auto), always, never")
    mesh = sub.add_parser("mesh", help="choose tensor x pipeline x data parallel sizes, micro-batches, schedule "
                                       "and stage boundaries for a number of devices")
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
    explain.add_argument("node", help="a node name, module path or parameter name; 'experts': the expert "
                                      "strategies' estimated step times")
    compare = sub.add_parser("compare", help="price hand-written plans (transformers', Megatron's, DTensor's) "
                                             "beside autotp's")
    _model_arguments(compare)
    compare.add_argument("--world-size", type=positive, required=True)
    from autotp.tools.compare import AGAINST
    compare.add_argument("--against", nargs="+", choices=AGAINST, default=list(AGAINST),
                         help="the hand-written plans to price (default: all that name this model's modules)")
    cal = sub.add_parser("calibrate", help="measure collectives on this machine's process group, write a topology")
    cal.add_argument("--out", default="calibrated.json", help="where to write the topology profile")
    cal.add_argument("--nproc", type=positive, default=2, help="local gloo ranks to spawn when not under torchrun")
    from autotp.tools.serve import add_serve_parser, serve_command
    add_serve_parser(sub, positive)
    commands = {"plan": _plan, "mesh": _mesh, "show": _show, "diff": _diff, "explain": _explain, "compare": _compare,
                "demo": _demo, "calibrate": _calibrate, "serve": serve_command}
    argv = sys.argv[1:] if argv is None else argv
    args = run(parser.parse_args, argv, "--debug" in argv)
    if isinstance(args, int):  # a usage error, already said
        return args
    if args.verbose:  # export's own notes on dims it specialized pass too (autotp says what they mean either way)
        logging.getLogger("autotp").setLevel(logging.DEBUG)
    else:  # a plan is priced at the example's sizes; which sizes a program would run at is for parallelize's users
        warnings.filterwarnings("ignore", message="autotp: the example inputs fix")
    return run(commands[args.command], args, args.debug)


if __name__ == "__main__":
    sys.exit(main())
