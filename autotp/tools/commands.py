"""What each ``autotp`` command does once its arguments are parsed (tools/cli.py parses them): one function per
command, each returning its exit status."""

from __future__ import annotations

import sys
from pathlib import Path

from autotp.tools.cli_errors import UsageError
from autotp.tools.model_spec import load_model
from autotp.tools.progress_bars import progress_bars


def _console():
    from rich.console import Console

    return Console(width=140, stderr=True)


def _output_paths_checked(args) -> None:
    """--out, --svg and --html can be written: said before a capture and solve, not after."""
    for flag in ("out", "svg", "html"):
        given = getattr(args, flag, None)
        if not given:
            continue
        path = Path(given)
        if path.is_dir():
            raise UsageError(f"--{flag} {given} is a folder", "give a file name inside it")
        if not path.parent.is_dir():
            raise UsageError(
                f"--{flag} {given}: folder {path.parent} does not exist",
                "create it, or give a path in one that does",
            )


def _checked(args) -> None:
    """The arguments a capture would need, checked before it (which takes seconds to minutes)."""
    from autotp.cost_models import load_topology

    _output_paths_checked(args)

    topology = load_topology(args.topology, getattr(args, "nodes", None))  # a name it does not know: one line
    for flag in ("world_size", "devices"):
        wanted = getattr(args, flag, None)
        if wanted is not None and wanted > topology.devices:
            raise UsageError(
                f"--{flag.replace('_', '-')} {wanted} is more than topology {topology.name} has "
                f"({topology.devices} devices)",
                "pick a topology with more devices (e.g. 2x-dgx-h100), --nodes N, or fewer ranks",
            )
    if args.memory_limit is not None and not args.memory_limit > 0:
        raise UsageError(
            f"--memory-limit must be a positive number of GB, got {args.memory_limit}",
            "give GB per device, e.g. --memory-limit 70",
        )


def plan_command(args) -> int:
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
        result = autotp.plan(
            model,
            example,
            world_size=args.world_size,
            topology=args.topology,
            training=not args.inference,
            fold=not args.no_fold,
            sequence_parallel={"auto": None, "on": True, "off": False}[args.sequence_parallel],
            recompute={"auto": None, "selective": "selective", "off": False}[args.recompute],
            async_tp={"auto": None, "on": True, "off": False}[args.async_tp],
            experts=None if args.experts == "auto" else args.experts,
            ep=args.ep,
            memory_limit=_limit(args),
        )
    if args.out:
        result.save(args.out)
    _figures(args, "plan", result)
    if args.json:
        print(result.to_json())
        return 0
    print_plan(result, tensor_shapes(model), every=args.all)
    return print_mesh(model, example, args) if args.devices else 0


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


def _limit(args) -> float | None:
    return args.memory_limit * 1e9 if args.memory_limit is not None else None


def mesh_command(args) -> int:
    _checked(args)
    with progress_bars(_console()):
        model, example = load_model(args.model, args.batch, args.seq)
    return print_mesh(model, example, args)


def print_mesh(model, example, args) -> int:
    """Price every tp x pp x dp layout of ``args.devices``; exit status 1 when nothing fits."""
    from rich.console import Console

    from autotp.planning.mesh_search import plan_mesh
    from autotp.planning.solution import PlanningError
    from autotp.tools.report import mesh_table

    with progress_bars(_console()):
        try:
            result = plan_mesh(
                model,
                example,
                devices=args.devices,
                topology=args.topology,
                nodes=args.nodes,
                global_batch=args.global_batch or args.batch,
                training=not args.inference,
                data_parallel=args.data_parallel,
                memory_limit=_limit(args),
                expert_imbalance=args.expert_imbalance,
                overlap_all_to_all=args.overlap_all_to_all,
                async_tp={"auto": None, "on": True, "off": False}[args.async_tp],
            )
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


def _load_plan(path: str):
    from autotp.plan import Plan, PlanMismatch

    try:
        return Plan.load(path)
    except OSError as exc:
        raise UsageError(
            f"cannot read {path} ({exc.strerror or exc})", "give a plan file written by autotp plan --out"
        ) from exc
    except (PlanMismatch, ValueError) as exc:
        raise UsageError(
            f"{path}: {str(exc).splitlines()[0]}", "give a plan file written by autotp plan --out"
        ) from exc


def show_command(args) -> int:
    from autotp.tools.report import print_plan

    _output_paths_checked(args)
    plan = _load_plan(args.plan)
    _figures(args, "plan", plan)
    print_plan(plan, every=args.all)
    return 0


def diff_command(args) -> int:
    from rich.console import Console

    from autotp.tools.report import diff_tables

    console = Console(width=140)
    for part in diff_tables(_load_plan(args.a), _load_plan(args.b)):
        console.print(part)
    return 0


def explain_command(args) -> int:
    from rich.console import Console

    from autotp.tools.report import explain_table

    try:
        Console(width=160).print(explain_table(_load_plan(args.plan), args.node))
    except KeyError as exc:
        raise UsageError(str(exc.args[0]), "autotp show PLAN lists the parameters and ops it names") from exc
    return 0


def compare_command(args) -> int:
    from rich.console import Console

    from autotp.tools.compare import compare
    from autotp.tools.report import compare_table

    _checked(args)
    with progress_bars(_console()):
        model, example = load_model(args.model, args.batch, args.seq)
        result = compare(
            model,
            example,
            world_size=args.world_size,
            topology=args.topology,
            training=not args.inference,
            memory_limit=_limit(args),
            against=args.against,
        )
    if result["hf_invalid"] and "hf" in args.against:
        print(f"{type(model).__name__}: Hugging Face's tp_plan is not valid here: {result['hf_invalid']}")
    labels = {"hf": "HF tp_plan", "megatron": "Megatron", "megatron-sp": "Megatron + SP", "dtensor": "DTensor"}
    plans = {labels[name]: result[name] for name in args.against if result.get(name)}
    plans.update({"HF ep_plan": result["hf_ep"]} if result.get("hf_ep") else {})
    invalid = [name for name in args.against if result.get(name) is False and name != "hf"]
    if invalid:
        print(
            f"{', '.join(invalid)}: the plan's even splits cut whole heads or other units at TP {args.world_size}, "
            "so no exact program runs it"
        )
    missing = [name for name in args.against if name not in result]
    if missing:
        print(
            f"no {', '.join(missing)} plan names modules of {type(model).__name__} "
            f"(autotp/tools/hand_plans.json lists their patterns)"
        )
    if not plans:
        print(f"autotp's plan: {result['autotp']['seconds'] * 1e6:.1f} µs per step (estimated); nothing to compare")
        return 1
    title = (
        f"{type(model).__name__} at TP {args.world_size}: hand-written plans vs autotp, each priced as it runs "
        "(one cost model)"
    )
    plans["autotp"] = result["autotp"]
    Console(width=160).print(compare_table(plans, title))
    for name, priced in plans.items():
        if priced.get("unpriced"):
            print(f"{name}: collectives of styles {', '.join(priced['unpriced'])} not counted (unknown to autotp)")
    return 0


def demo_command(args) -> int:
    from autotp.tools.demo import main as demo

    return demo()


def calibrate_command(args) -> int:
    from autotp.tools.calibrate_cli import main as calibrate

    _output_paths_checked(args)
    return calibrate(args.out, args.nproc)
