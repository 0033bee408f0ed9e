"""Coverage sweep: every architecture of the installed transformers (and the models of the ``sweep`` extra), shrunk
by one generic rule (benchmarks/coverage_models.py), planned for 2 ranks on the meta device and, where asked, run on
2 gloo ranks against one process.

    HF_HUB_OFFLINE=1 python benchmarks/coverage_sweep.py plan  [--only T1 T2] [--limit N] [--chunk I/K]
    HF_HUB_OFFLINE=1 python benchmarks/coverage_sweep.py exact [--only ...] [--minutes M]
    python benchmarks/coverage_sweep.py summary             # the table and benchmarks/coverage/summary.md

``plan`` records per architecture (JSON lines, benchmarks/coverage/plan-<time>.jsonl; entries in earlier files are
skipped, so a stopped run resumes): whether the shrunk config builds and runs one forward on the CPU, whether autotp's
capture (torch.export) takes it, the plan's share of block (numbered, non-embedding) weights per rank, the forward
collectives per block against Megatron's (2 a block, 3 with cross-attention; an all-gather or a reduce-scatter counts
half an all-reduce, an all-to-all pair one), whether every attention core (SDPA, softmax, flex) is split by heads, and
why ops ran replicated. ``exact`` runs the models that planned on 2 gloo ranks (autotp.tools.spawn), comparing outputs
and gradients with one process at fp32 rtol 1e-4 / atol 1e-5 (a value off by more is measured against float64: at most
4 times as far from it as one process is, it is fp32 rounding, recorded as such). The whole run is pinned to one core.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import time
import traceback
from collections import Counter
from pathlib import Path

import coverage_models as cm
import torch
from coverage_build import alarm, build, first_line, names, probe
from coverage_exact import exact_entry
from coverage_library import OTHERS
from coverage_measures import measure
from machine import describe

OUT = Path(__file__).resolve().parent / "coverage"
RUN_BATCH, RUN_SEQ = 8, 1024  # the shapes plans are priced at (run_shapes)
# Parameters of at least hidden x hidden elements (the shrunk width, cm.HIDDEN) only offered sharded, as for a model
# too large for one device, what TP is for: at the sweep's widths replicating a small attention beside a wide MLP or
# conv stem is rightly cheaper.  Narrower ones (a router's rows of 4 experts, a low-rank down projection, a depthwise
# kernel, norm and bias vectors) are left to the cost model, as Megatron and vLLM keep them whole.  A fraction of the
# largest parameter would not do: that is a vocabulary, a position table or a conv stem, sized unlike the blocks.
SHARD_FROM = cm.HIDDEN**2


def _plan(model, kwargs, full: dict | None = None):
    """autotp.plan(model, (), kwargs, world_size=2, **options) as api.plan writes it, keeping the graph (shapes
    of its ops) and the options: priced at a run's shapes (run_shapes), a block's matrices only offered sharded
    (``full``: the full config's parameter sizes, see inflated)."""
    from autotp.options import PlanOptions
    from autotp.passes.prepared_graph import prepared_graph
    from autotp.planning.tensor_plan import solve_plan

    gm = prepared_graph(model, (), kwargs, True)
    # the largest the graph reads, as the planner's fraction is of those (a vision tower a text input never runs
    # would lower the bar below hidden x hidden)
    params = dict(gm.named_parameters(remove_duplicate=False))
    read = {n.target: params[n.target].numel() for n in gm.graph.nodes if n.op == "get_attr" and n.target in params}
    sizes = inflated(read, full or {})
    largest = max({**read, **sizes}.values(), default=1)  # the bar stays at SHARD_FROM elements
    options = {"price_at": run_shapes(gm), "min_shard_fraction": min(1.0, SHARD_FROM / largest)}
    if sizes:
        options["parameter_sizes"] = sizes
    return solve_plan(gm, 2, PlanOptions(**options), price_experts=True), gm, options


def full_sizes(name: str, model) -> dict:
    """Parameter name -> elements in the full config's model at the same depth (built on meta): {} where that does
    not build or names differ."""
    if name in OTHERS:
        return {}
    try:
        with torch.device("meta"):
            full = type(model)(cm.hf_config(name, widths=False))
    except Exception:
        return {}
    sizes = {n: p.numel() for n, p in full.named_parameters(remove_duplicate=False)}
    return sizes if all(n in sizes for n, _ in model.named_parameters(remove_duplicate=False)) else {}


def inflated(read: dict, full: dict) -> dict:
    """The parameters the shrink made large beside the rest, at their full sizes over the typical growth: a
    relative-position MLP or a state-space dt projection of fixed width, as wide as hidden x hidden at hidden 64 but
    a thousandth of a projection in the full model.  The forcing compares those as the full model has them; the rest
    at their own sizes (a query projection, hidden x hidden in both, stays at the bar).  Typical: the median growth
    of the parameters the forcing holds sharded; inflated: grown 8 times less than that."""
    growth = {n: full[n] / size for n, size in read.items() if n in full and size}
    typical = sorted(g for n, g in growth.items() if read[n] >= SHARD_FROM)
    if not typical:
        return {}
    median = typical[len(typical) // 2]
    return {n: int(full[n] / median) for n, g in growth.items() if g * 8 < median and read[n] >= SHARD_FROM}


def at_count(plan, model, gm, options: dict, modules: list[str], over: int, full: dict | None = None) -> dict:
    """The plan a hand-written one is where autotp's is over Megatron's count: the modules whose values the extra
    collectives move (a DSA indexer, a relative-position table, a low-rank projection) computed whole on every rank
    in every block, as a hand plan replicates them, the rest planned as before, priced by the same cost model.  Only
    modules whose weights the forcing lets be whole (a hand plan shards a block's large matrices too).  autotp's plan
    is better where that plan, with heads split, has fewer collectives a block (those modules are where the extra
    ones come from: a DSA indexer, hyper-connections) and costs at least as much a step.  A plan that computes them
    whole and is over by as many says nothing (a norm kept whole beside a large conv's extra sum)."""
    from autotp.options import PlanOptions
    from autotp.placement import Replicate
    from autotp.planning.analysis import offered
    from autotp.planning.tensor_plan import solve_plan

    forced = {
        n
        for n, placements in offered(gm, 2, PlanOptions(**options)).items()
        if not any(isinstance(p, Replicate) for p in placements)
    }
    patterns = [
        re.compile(r"\.".join(r"\d+" if part.isdigit() else re.escape(part) for part in m.split("."))) for m in modules
    ]  # the same module in every block
    names = [n for n, _ in model.named_modules() if n and any(p.fullmatch(n) for p in patterns)]
    holding = {m for m in names if any(p.startswith(m + ".") for p in forced)}
    whole = {m: "R" for m in names if m not in holding}
    left = sorted({m for m in modules if m in holding})
    if not whole:
        return {"kept_whole": [], "holding_forced": left, "better": False}
    other = solve_plan(gm, 2, PlanOptions(**options, fixed=whole), price_experts=True)
    found = measure(other, model, gm, full)
    fewer = found["over_megatron"] <= 0 or found["over_megatron"] < over
    better = fewer and not found["unsplit_attention"] and plan.cost["seconds"] <= other.cost["seconds"] * (1 + 1e-9)
    return {
        "kept_whole": [m for m in modules if m not in holding],
        "holding_forced": left,
        "modules": len(whole),
        "over_megatron": found["over_megatron"],
        "unsplit_attention": found["unsplit_attention"],
        "share": found["share"],
        "seconds": other.cost["seconds"],
        "autotp_seconds": plan.cost["seconds"],
        "better": better,
    }


def run_shapes(gm) -> dict:
    """The shapes the sweep prices at: the tiny example's widths, a run's tokens.  Of the dims the capture made
    dynamic, the batch (dim 0) at RUN_BATCH and a token sequence (dim 1 of a 2-D input) at least RUN_SEQ; other
    dims as in the example."""
    found = {}
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op != "placeholder" or not isinstance(val, torch.Tensor):
            continue
        dynamic = [isinstance(s, torch.SymInt) and s.node.expr.is_Symbol for s in val.shape]
        shape = [None] * val.dim()
        if dynamic and dynamic[0]:
            shape[0] = RUN_BATCH
        if val.dim() == 2 and dynamic[1]:
            shape[1] = max(RUN_SEQ, val.shape[1].node.hint)  # (int() would guard: the capture fixed at 8)
        if any(shape):
            found[n.name] = shape
    return found


def plan_entry(name: str, timeout: int) -> dict:
    from autotp.passes.capture import CaptureError

    entry, start = {"name": name}, time.perf_counter()
    alarm(timeout)
    try:
        stage = "build"
        spec = probe(name)
        entry.update(family=spec.pop("family"), spec=spec, built=True)
        stage = "meta build"
        try:
            model, kwargs, _ = build(name, "meta", spec)
            entry["meta_build"] = "meta"
        except Exception:  # a constructor that computes on tensors (.item(), linspace().tolist()): build, then move
            model, kwargs, _ = build(name, "cpu", spec)
            model, kwargs = model.to("meta"), {k: v.to("meta") for k, v in kwargs.items()}
            entry["meta_build"] = "cpu, moved to meta"
        stage = "full sizes"
        full = full_sizes(name, model)
        stage = "plan"
        try:
            plan, gm, options = _plan(model, kwargs, full)
        except CaptureError as exc:  # on meta: try the same on the CPU, then a plain static torch.export
            entry.update(captured=False, capture_error=first_line(exc).split("\n")[0])
            model, kwargs, _ = build(name, "cpu", spec)
            try:
                plan, gm, options = _plan(model, kwargs, full)
                entry["planned_on"] = "cpu (the capture on meta failed)"
            except CaptureError:
                stage = "plain export"
                torch.export.export(model, (), kwargs, strict=False)  # static shapes, one process: the denominator
                entry.update(captured=True, autotp_capture=False)  # plain export takes it, autotp's capture did not
                return entry
        entry["spec"]["options"] = options  # the exact run's parallelize plans alike
        entry.update(
            captured=True,
            autotp_capture=True,
            planned=True,
            share_weighed="full config" if full else "own",
            **measure(plan, model, gm, full),
        )
        if entry["over_megatron"] > 0 and entry["over_modules"]:
            stage = "plan at Megatron's count"
            entry["at_count"] = at_count(plan, model, gm, options, entry["over_modules"], entry["over_megatron"], full)
    except Exception as exc:  # every failure is a result: recorded with its stage
        entry.update(stage=stage, error=first_line(exc), where=_where(exc))
        entry.setdefault("built", False)
        if stage == "plan" and "captured" not in entry:  # autotp failed after its capture: does export take it?
            entry["captured"] = _exports(name, entry["spec"])
    finally:
        signal.alarm(0)
        entry["seconds"] = round(time.perf_counter() - start, 2)
    return entry


def _exports(name: str, spec: dict) -> bool:
    try:
        model, kwargs, _ = build(name, "cpu", spec)
        torch.export.export(model, (), kwargs, strict=False)
        return True
    except Exception:  # not capturable in one process: outside the denominator
        return False


def _where(exc: BaseException) -> str:
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__) if "site-packages" in f.filename or "/autotp/" in f.filename
    ]
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""


def records(part: str) -> dict:
    """name -> its latest record of ``part`` over every run's file.  A start with no result is run again once (the
    run may have been stopped); twice: the process died on it."""
    found, started = {}, Counter()
    for path in sorted(OUT.glob(f"{part}-*.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if entry.get("started"):
                started[entry["name"]] += 1
            elif not (entry.get("error", "").startswith("Timeout") and found.get(entry["name"], {}).get("planned")):
                found[entry["name"]] = entry  # (a timeout on a busy core does not undo an earlier plan)
    for name in {n for n, k in started.items() if k > 1} - set(found):
        found[name] = {"name": name, "stage": "process", "error": "the process died on this model", "result": "crash"}
    return found


def run(part: str, todo: list[str], timeout: int, minutes: float, limit: int | None, redo: str | None) -> None:
    OUT.mkdir(exist_ok=True)
    done = records(part)
    if redo == "all":
        done = {}
    elif redo == "failed":  # recorded, but not built (plan) or not exact (exact): run again, the new record wins
        done = {n: e for n, e in done.items() if e.get("built") or e.get("result") == "exact"}
    todo = [n for n in todo if n not in done][:limit]
    path = OUT / f"{part}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    planned = records("plan")
    stop = time.monotonic() + minutes * 60
    print(f"{part}: {len(todo)} to run, {len(done)} already recorded; writing {path.name}", flush=True)
    for i, name in enumerate(todo):
        if time.monotonic() > stop:
            print(f"stopped after {minutes} minutes", flush=True)
            break
        with path.open("a") as f:
            f.write(json.dumps({"name": name, "started": True}) + "\n")
        if part == "plan":
            entry = plan_entry(name, timeout)
        else:
            entry = exact_entry(name, planned[name]["spec"], timeout, 4 if part == "exact4" else 2)
        with path.open("a") as f:
            f.write(json.dumps(entry) + "\n")
        status = entry.get("result") or ("planned" if entry.get("planned") else entry.get("error", "captured")[:90])
        print(f"[{i + 1}/{len(todo)}] {name}: {status} ({entry['seconds']} s)", flush=True)


def main() -> None:
    from coverage_summary import summarize

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "part",
        choices=["plan", "exact", "exact4", "summary"],
        help="exact4: exactness at 4 ranks, the first planned model of each family",
    )
    parser.add_argument("--only", nargs="+", help="these model types / library models only")
    parser.add_argument("--limit", type=int, help="the first N of those left to run")
    parser.add_argument("--chunk", help="I/K: the I-th of K equal slices of the list (1-based)")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per model")
    parser.add_argument("--minutes", type=float, default=float("inf"), help="stop starting models after this long")
    parser.add_argument(
        "--redo",
        choices=["failed", "all"],
        help="run recorded ones again: those that failed (plan: did not build; exact: not exact), or all",
    )
    parser.add_argument("--core", type=int, default=0, help="the one CPU core the run (and its ranks) is pinned to")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.part == "summary":
        summarize(records("plan"), records("exact"), records("exact4"))
        return
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    print(describe("gloo"), flush=True)
    todo = args.only or names()
    if args.part != "plan":  # the models that planned
        planned = records("plan")
        todo = [n for n in todo if planned.get(n, {}).get("planned")]
    if args.part == "exact4":  # one a family: its first in name order, whatever it does at 2 ranks
        from coverage_build import family_of

        firsts: dict = {}
        for name in sorted(todo):
            firsts.setdefault(family_of(name) or planned[name].get("family"), name)
        todo = sorted(firsts.values())
    if args.chunk:
        i, k = map(int, args.chunk.split("/"))
        todo = todo[(i - 1) * len(todo) // k : i * len(todo) // k]
    run(args.part, todo, args.timeout, args.minutes, args.limit, args.redo)
    summarize(records("plan"), records("exact"), records("exact4"))


if __name__ == "__main__":
    main()
