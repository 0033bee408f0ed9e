"""Human-readable views of a plan (rich tables); decisions are described from the graph."""

from __future__ import annotations

import re
from collections import Counter

import torch
from rich.console import Console
from rich.table import Table

from autotp.placement import NOTATION, Disjoint, Routed, Shard
from autotp.plan import Plan


def tensor_shapes(model: torch.nn.Module) -> dict:
    """Full shapes of every parameter and buffer, by every name they have."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {name: tuple(t.shape) for name, t in named}


def plan_table(plan: Plan, shapes: dict | None = None, every: bool = False) -> Table:
    """Each parameter's decision.  A run of consecutive blocks of one list whose parameters are placed
    alike is shown once, as its first block and one row for the rest (``every``: one row a parameter)."""
    table = Table(
        title=f"autotp plan: {plan.world_size} ranks, topology {plan.topology}",
        caption=None if every else "blocks placed alike are shown once; --all lists every parameter",
    )
    for column in ("parameter", "decision", "placement", "local shape (per rank)"):
        table.add_column(column)
    rows = {name: _param_row(plan, shapes, name) for name in plan.params}
    for row in [(n, *rows[n]) for n in sorted(rows, key=_natural)] if every else _fold_blocks(rows):
        table.add_row(*row)
    return table


def _param_row(plan: Plan, shapes: dict | None, name: str) -> tuple:
    placement = plan.placement(name)
    local = local_shapes(placement, shapes[name], plan.world_size) if shapes and name in shapes else "?"
    return plan.styles.get(name, ""), str(placement), local


def local_shapes(placement, shape, world: int) -> str:
    """The piece each rank holds: one shape when every rank's is alike, else each shape with its ranks
    ("3x64 on ranks 0-1, 2x64 on 2-3"); expert weights by the experts a rank holds."""
    shard, ranks = placement, world
    if isinstance(placement, (Disjoint, Routed)):  # whole experts dealt out along their dim
        shard, ranks = placement.experts, getattr(placement, "ranks", world)
    pieces: dict[str, list[int]] = {}
    for rank in range(ranks if isinstance(shard, Shard) else 1):
        dims = list(shape)
        if isinstance(shard, Shard):
            dims[shard.dim] = shard.local_size(dims[shard.dim], rank, ranks)
        pieces.setdefault("x".join(map(str, dims)), []).append(rank)
    if len(pieces) == 1:
        return next(iter(pieces))
    return ", ".join(f"{dims} on {_span(held)}" for dims, held in pieces.items())


def _span(ranks: list[int]) -> str:
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return "ranks " + ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def _natural(name: str) -> list:
    """Sort key that puts layers.2 before layers.10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _fold_blocks(rows: dict) -> list:
    """(name, *row) in natural order; after a block, the following blocks of its list whose rows equal
    its rows (names relative to the block) become one row."""
    blocks: dict = {}
    for name in rows:
        block = _block(name)
        if block != name and block.rpartition(".")[2].isdigit():
            blocks.setdefault(block, []).append(name)
    alike = {block: sorted((n[len(block) :], rows[n]) for n in names) for block, names in blocks.items()}
    out, shown = [], set()
    for name in sorted(rows, key=_natural):
        if name in shown:
            continue
        block = _block(name)
        if block not in blocks:
            out.append((name, *rows[name]))
            continue
        path, _, first = block.rpartition(".")
        run = [block]
        while alike.get(following := f"{path}.{int(first) + len(run)}") == alike[block]:
            run.append(following)
        out += [(n, *rows[n]) for n in sorted(blocks[block], key=_natural)]
        if len(run) == 2:
            out.append((run[1], f"as {block}", "", ""))
        elif len(run) > 2:
            out.append((f"{run[1]} … {run[-1]}", f"each as {block} ({len(run) - 1} blocks)", "", ""))
        shown.update(n for b in run for n in blocks[b])
    return out


_ORDER = ["params", "grads", "optimizer", "buffers", "activations", "kv_cache", "temporaries", "total"]


def _block(module: str) -> str:
    """The enclosing repeated block of a module path (``model.layers.3``), for grouping in reports."""
    found = re.match(r"(.*?\.\d+)(\.|$)", module)
    return found.group(1) if found else (module or "(top level)")


def collectives_table(plan: Plan) -> Table:
    """Collectives per block: how many of each kind, bytes and estimated time per step."""
    training = plan.cost.get("training", True)
    table = Table(title="collectives per step, by block" if training else "collectives per forward, by block")
    for column in ("block", "forward", *(("backward",) if training else ()), "bytes", "est. µs"):
        table.add_column(column)
    blocks: dict = {}
    for c in plan.collectives:
        fresh = {"forward": Counter(), "backward": Counter(), "b": 0.0, "s": 0.0}
        alike = c.get("count", 1) - 1  # a folded plan's block 1 stands for the middle blocks
        entry = blocks.setdefault(_block(c["module"]) + (f" (and {alike} more alike)" if alike else ""), fresh)
        entry[c["phase"]][c["op"]] += 1
        entry["b"] += c["bytes"]
        entry["s"] += c["seconds"]
    for block, e in blocks.items():
        table.add_row(
            block,
            _counts(e["forward"]),
            *((_counts(e["backward"]),) if training else ()),
            f"{e['b']:.0f}",
            f"{e['s'] * 1e6:.1f}",
        )
    return table


def _counts(counter: Counter) -> str:
    return ", ".join(f"{n} {op}" for op, n in sorted(counter.items())) or "-"


def diff_tables(a: Plan, b: Plan) -> list:
    """What changed between two plans: parameter decisions and the estimated cost."""
    changed = Table(title="parameters placed differently")
    for column in ("parameter", "a", "b"):
        changed.add_column(column)
    for name in sorted(set(a.params) | set(b.params)):
        if a.params.get(name) != b.params.get(name):
            changed.add_row(
                name,
                f"{a.params.get(name, '-')} {a.styles.get(name, '')}",
                f"{b.params.get(name, '-')} {b.styles.get(name, '')}",
            )
    cost = Table(title="estimated cost")
    for column in ("", "a", "b", "b - a"):
        cost.add_column(column, justify="right")
    rows = [
        ("world size", a.world_size, b.world_size),
        ("topology", a.topology, b.topology),
        ("step µs", a.cost.get("seconds", 0) * 1e6, b.cost.get("seconds", 0) * 1e6),
        (
            "memory/device MB",
            a.cost.get("memory", {}).get("total", 0) / 1e6,
            b.cost.get("memory", {}).get("total", 0) / 1e6,
        ),
        ("forward collectives", a.collective_counts("forward").total(), b.collective_counts("forward").total()),
    ]
    for label, x, y in rows:
        delta = f"{y - x:+.4g}" if isinstance(x, (int, float)) and isinstance(y, (int, float)) else ""
        cost.add_row(
            label, f"{x:.2f}" if isinstance(x, float) else str(x), f"{y:.2f}" if isinstance(y, float) else str(y), delta
        )
    same = "same model" if a.fingerprint == b.fingerprint else "DIFFERENT models (fingerprints differ)"
    return [changed if changed.row_count else "no parameter is placed differently", cost, same]


def experts_table(plan: Plan) -> Table:
    """The expert strategies' estimated step times, each the best plan with it imposed (plan.cost["experts"])."""
    experts = plan.cost.get("experts")
    if not experts:
        raise KeyError("this plan had no choice of expert strategy (no experts, or one imposed)")
    ep = plan.mesh.get("ep", 1)
    table = Table(
        title=f"expert strategies at TP {plan.world_size}{f' x EP {ep}' if ep > 1 else ''} on "
        f"{plan.topology} (estimated step time of the best plan with each imposed)"
    )
    for column in ("strategy", "est. step ms", ""):
        table.add_column(column)
    names = {
        "tensor": "expert tensor parallelism (every expert split)",
        "parallel": "expert parallelism, local compute (whole experts, zero rows for others' tokens)",
        "all-to-all": f"expert parallelism by all-to-all (whole experts over {plan.world_size} ranks, rows "
        "sent to their owners)",
    }
    if ep > 1:
        names = {
            "tensor": f"EP {ep} x expert TP {plan.world_size} (experts dealt over ep, each split over tp)",
            "all-to-all": f"EP {ep * plan.world_size} x expert TP 1 (whole experts over ep x tp)",
        }
    for mode, seconds in experts["seconds"].items():
        table.add_row(
            names[mode],
            "does not fit" if seconds is None else f"{seconds * 1e3:.3f}",
            "chosen" if experts["chosen"] == mode else "",
        )
    return table


def explain_table(plan: Plan, target: str) -> Table:
    """The solver's options for the ops matching ``target`` (a node, module or parameter name)."""
    if target == "experts":
        return experts_table(plan)
    module = target.removesuffix(".weight").removesuffix(".bias")
    names = [n for n, e in plan.nodes.items() if target in (n, e.get("module")) or module == e.get("module")]
    names = [n for n in names if n in plan.alternatives] or names
    if not names:
        raise KeyError(f"no op named {target!r} in this plan; give a node name (see --json) or a module path")
    table = Table(title=f"alternatives for {target} (each priced with its neighbours' choices fixed)", caption=NOTATION)
    for column in ("op", "inputs", "output", "est. µs", "kept MB", ""):
        table.add_column(column)
    for name in names:
        options = plan.alternatives.get(name) or [{**plan.nodes[name], "seconds": None, "chosen": True}]
        for option in options:
            seconds = "impossible" if option["seconds"] is None else f"{option['seconds'] * 1e6:.2f}"
            kept = "-" if option.get("kept") is None else f"{option['kept'] / 1e6:.3f}"
            table.add_row(
                f"{name} ({plan.nodes[name].get('op', '')})",
                ", ".join(map(str, option["in"])),
                str(option["out"]),
                seconds,
                kept,
                "chosen" if option.get("chosen") else "",
            )
    return table


def print_plan(plan: Plan, shapes: dict | None = None, console: Console | None = None, every: bool = False) -> None:
    console = console or Console(width=140)
    console.print(plan_table(plan, shapes or plan.shapes, every))
    console.print(collectives_table(plan))
    console.print(memory_table(plan))
    if plan.cost.get("activations") and plan.cost.get("training", True):  # inference keeps nothing for a backward
        console.print(activations_table(plan))
    if plan.fold:
        start = plan.fold.get("start", 0)
        console.print(
            f"{plan.fold['count'] - start} identical blocks of {plan.fold['path']} planned from four: "
            f"blocks {start + 1} to {plan.fold['count'] - 2} take the same decisions"
        )
    if plan.cost.get("dropout"):
        console.print(
            f"dropout: the program drops in {len(plan.cost['dropout'])} modules (captured in training mode; "
            "sharded.eval() stops it; docs/dropout.md)"
        )
    for layout, count in Counter(v for v in plan.quantized.values() if not v.startswith("the ")).items():
        console.print(f"stored quantized: {count} weights, {layout}, split only between whole ones (scales alike)")
    if plan.cost.get("experts"):
        console.print(f"experts: {plan.cost['experts']['chosen']} (`autotp explain PLAN experts` prices each)")
    for op, why in plan.cost.get("replicated", dict.fromkeys(plan.replicated_ops, "no sharding rule")).items():
        console.print(f"runs replicated: {op}: {why}", highlight=False)
    console.print(
        f"estimated {'training step' if plan.cost.get('training') else 'forward'} time "
        f"{plan.cost.get('seconds', 0) * 1e6:.1f} µs per device"
    )
    overlap = plan.cost.get("async_tp")
    if overlap:  # plans solved before asynchronous TP was priced have none
        console.print(
            f"asynchronous TP: {'on' if overlap['chosen'] else 'off'} ({overlap.get('why', '')}); "
            f"{len(overlap['fused'])} collective(s) fused with their matmuls, saving "
            f"{overlap['saved_seconds'] * 1e6:.1f} µs",
            highlight=False,
        )


def memory_table(plan: Plan) -> Table:
    table = Table(title="memory per device (estimated)")
    table.add_column("kind")
    table.add_column("MB", justify="right")
    memory = plan.cost.get("memory", {})
    for kind in sorted(memory, key=lambda k: _ORDER.index(k) if k in _ORDER else len(_ORDER)):
        table.add_row(kind, f"{memory[kind] / 1e6:.3f}")
    return table


def activations_table(plan: Plan) -> Table:
    """Bytes each block keeps for backward (per device), whether it splits the tokens and whether it
    recomputes its attention core."""
    table = Table(title="activations kept for backward, by block (estimated, per device)")
    for column in ("block", "MB", "sequence parallel", "recompute"):
        table.add_column(column)
    kept: dict = {}
    for module, held in plan.cost["activations"].items():
        kept[_block(module)] = kept.get(_block(module), 0.0) + held
    split = {_block(m) for m in plan.cost.get("token_split", ())}
    again = {_block(m) for m in plan.cost.get("recompute", ())}
    for block in sorted(kept, key=_natural):
        table.add_row(
            block or "(top level)",
            f"{kept[block] / 1e6:.3f}",
            "yes" if block in split else "no",
            "attention" if block in again else "no",
        )
    return table


def mesh_table(result) -> list:
    """The best layout per (TP, PP, DP, EP) of autotp.planning.mesh_search.plan_mesh, fastest first, then the choice."""
    from autotp.planning.mesh_search import TIE_RULE, activation_options, layout_name

    table = Table(
        title=f"mesh candidates: {result.devices} devices of {result.topology}, global batch "
        f"{result.global_batch}, data parallel {result.data_parallel} (estimated)"
    )
    for column in (
        "TP",
        "PP",
        "DP",
        "EP",
        "micro-batches",
        "schedule",
        "bubble",
        "SP",
        "recompute",
        "step s",
        "memory/device GB",
        "MFU",
        "note",
        "",
    ):
        table.add_column(column)
    for c in result.candidates:
        schedule = "-" if c.schedule is None else c.schedule + (f" x{c.virtual_stages}" if c.virtual_stages > 1 else "")
        experts = "-" if c.ep == 1 else f"{c.ep}" + (" whole" if c.etp == 1 and c.tp > 1 else "")
        batches = f"{c.microbatches} x {c.microbatch_size}" if c.microbatches and c.microbatch_size else "-"
        table.add_row(
            str(c.tp),
            str(c.pp),
            str(c.dp),
            experts,
            batches,
            schedule,
            f"{c.bubble:.1%}" if c.schedule else "-",
            ("yes, async TP" if c.async_tp else "yes") if c.sequence_parallel else "no",
            "full" if c.recompute else "attention" if c.selective else "no",
            "-" if c.step_seconds is None else f"{c.step_seconds:.3g}",
            "-" if c.memory_bytes is None else f"{c.memory_bytes / 1e9:.2f}",
            "-" if c.mfu is None else f"{c.mfu:.1%}",
            c.note,
            "chosen" if c is result.choice else "",
        )
    best = result.choice
    return [
        table,
        f"mesh choice: {layout_name(best)}, {best.microbatches} micro-batches of "
        f"{best.microbatch_size}, schedule {best.schedule or '-'}"
        f"{f' x{best.virtual_stages}' if best.virtual_stages > 1 else ''}"
        f"{f' (bubble {best.bubble:.1%} of the step)' if best.schedule else ''}"
        f"{activation_options(best)}; {_stages(best.stages)}",
        f"the choice (marked): {TIE_RULE}",
        result.activation_model,
    ]


def _stages(stages: list) -> str:
    """Block ranges per (virtual) stage, the middle elided when there are many."""
    if len(stages) == 1:
        return "one stage"
    shown = [f"{a}-{b - 1}" for a, b in stages]
    if len(shown) > 8:
        shown = [*shown[:3], "...", *shown[-2:]]
    return f"{len(stages)} stages, blocks {' | '.join(shown)}"


def compare_table(plans: dict, title: str) -> Table:
    """Plan summaries (autotp.tools.compare.summary) side by side, one column per {name: summary}."""
    table = Table(title=title)
    for column in ("", *plans):
        table.add_column(column, justify="right")
    table.add_row("est. step µs", *(f"{p['seconds'] * 1e6:.1f}" for p in plans.values()))
    for phase in ("forward", "backward"):  # an inference plan's summaries list no backward collectives
        for op in sorted(set().union(*(p[phase] for p in plans.values()))):
            table.add_row(f"{phase} {op}", *(str(p[phase].get(op, 0)) for p in plans.values()))
    table.add_row("parameter MB/device", *(f"{p['param_bytes'] / 1e6:.3f}" for p in plans.values()))
    table.add_row("memory MB/device", *(f"{p['memory'] / 1e6:.3f}" for p in plans.values()))
    return table
