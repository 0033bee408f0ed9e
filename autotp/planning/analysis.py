"""What the rules may ask of a graph before they propose: the parameters a user fixed (tied names included),
expert segments, hints, the gradients' path and the token sizes; and the candidates the rules then offer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from autotp.ops import expert_segments
from autotp.ops.strategies import Context, needs_grad, token_inputs
from autotp.ops.table import TABLE
from autotp.options import PlanOptions
from autotp.passes.capture import within
from autotp.passes.hints import with_hints
from autotp.placement import R
from autotp.planning.candidates import Candidates, enumerate_strategies


def offered(gm: torch.fx.GraphModule, world_size: int, options: PlanOptions | None = None) -> dict[str, list[Any]]:
    """Parameter name -> the placements the solver may give it on ``world_size`` ranks (each one every reader of
    the parameter takes without moving it)."""
    options = options or PlanOptions()
    found = candidates(gm, world_size, options, False, options.experts)
    return {
        n.target: [s.output for s in found.strategies[n]]
        for n in gm.graph.nodes
        if n.op == "get_attr" and n in found.strategies
    }


def tied_names(gm: torch.fx.GraphModule, fixed: Mapping[str, Any]) -> dict[str, Any]:
    """``fixed`` under every name of each weight it names: a tied weight is read by one of its names (GPT-2's
    embedding as ``lm_head.weight``), whichever the user placed."""
    names: dict[int, list[str]] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    found = dict(fixed)
    for group in names.values():
        placed = [fixed[n] for n in group if n in fixed]
        if placed:
            found.update({n: found.get(n, placed[0]) for n in group})
    return found


def fixed_parameters(gm: torch.fx.GraphModule, fixed: Mapping[str, Any]) -> tuple[dict[str, Any], frozenset[str]]:
    """``fixed`` as parameter placements (tied names included) and the modules it computes whole: a name that is
    no parameter is a module's, fixed "R" (a router or an indexer kept whole, as a hand plan replicates it), which
    holds each parameter under it whole too."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    modules = {name for name in fixed if name not in params}
    for name in modules:
        if fixed[name] != R:
            raise ValueError(
                f"fixed[{name!r}] = {fixed[name]}: {name!r} is no parameter of the model, and a module "
                f'can only be fixed "R" (computed whole on every rank)'
            )
    inside = {p: R for p in params if within(p, modules)}
    return tied_names(gm, {**inside, **{k: v for k, v in fixed.items() if k not in modules}}), frozenset(modules)


def analyse(
    gm: torch.fx.GraphModule, world_size: int, options: PlanOptions, tokens: bool, experts: str | None
) -> Context:
    """What the rules may ask: expert segments, then the hints, then the gradients' path and the token sizes
    (each found with the ones before it known, as the rules that find them read them)."""
    fixed, whole = fixed_parameters(gm, options.fixed or {})
    ctx = Context(
        world=world_size,
        min_shard_fraction=options.min_shard_fraction,
        parameter_sizes=dict(options.parameter_sizes or {}),
        fixed=fixed,
        whole=whole,
        tokens=tokens,
        experts=experts,
        ep=options.ep,
        ops=TABLE,
    )
    ctx = replace(ctx, segments=expert_segments.members(expert_segments.find(gm, ctx)))
    ctx = with_hints(gm, ctx)
    return replace(ctx, grad=frozenset(needs_grad(gm)), token_symbols=frozenset(token_inputs(gm.graph)))


def candidates(
    gm: torch.fx.GraphModule, world_size: int, options: PlanOptions, tokens: bool, experts: str | None
) -> Candidates:
    return enumerate_strategies(gm, analyse(gm, world_size, options, tokens, experts))
