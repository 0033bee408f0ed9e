"""Cut a model into a chain of stage modules at block boundaries with torch.distributed.pipelining's tracer.

``torch.distributed.pipelining.pipeline`` exports the model and cuts it where blocks begin; its stage modules
keep the original parameter names.  A value computed early and read by several later stages (rotary tables, the
attention mask) goes straight from its stage to each reader in that graph, while ``PipelineStage`` receives only
from the stage before: each stage in between is given the value as an extra input and returns it, so every stage
takes exactly what the previous one returns.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.distributed.pipelining import SplitPoint
from torch.distributed.pipelining import pipeline as trace_pipeline
from torch.utils._pytree import tree_flatten

from .stages import StageError


@dataclass
class Split:
    modules: list    # stage index -> stage module (fx GraphModule, original parameter names)
    inputs: list     # stage index -> its (args, kwargs) on the example micro-batch
    out_spec: object  # the model output's pytree structure (the last stage returns its leaves)


def split(model: torch.nn.Module, mb_args: tuple, mb_kwargs: dict, path: str, starts: list) -> Split:
    """Stages beginning at blocks ``starts`` of the block list at ``path``.  pipelining marks split points by
    replacing block forwards on the instance; they are put back, so the user's model is left as it was."""
    marked = [model.get_submodule(f"{path}.{k}") for k in starts[1:]]
    try:
        pipe = trace_pipeline(model, mb_args, mb_kwargs,
                              split_spec={f"{path}.{k}": SplitPoint.BEGINNING for k in starts[1:]})
    finally:
        for block in marked:
            for attr in ("forward", "_orig_forward"):
                block.__dict__.pop(attr, None)
    if pipe.num_stages != len(starts):
        raise StageError(f"splitting at blocks {starts} gave {pipe.num_stages} stages, not {len(starts)}")
    shared = [sorted(uses.values()) for uses in pipe.replicated_params]
    if shared:
        raise StageError(f"parameters used by more than one stage ({shared}): their gradients would not be summed "
                         "across stages; untie them (e.g. tie_word_embeddings=False) or use fewer stages")
    modules = _chain(pipe)
    inputs, args, kwargs = [], mb_args, mb_kwargs
    with torch.no_grad():
        for module in modules:
            inputs.append((args, kwargs))
            out = module(*args, **kwargs)
            args, kwargs = (tuple(out) if isinstance(out, (tuple, list)) else (out,)), {}
        out_spec = tree_flatten(model(*mb_args, **mb_kwargs))[1]
    return Split(modules, inputs, out_spec)


def _chain(pipe) -> list:
    """The stage modules, rewired so that each returns exactly what the next one takes."""
    graph = pipe.split_gm.graph
    calls = [n for n in graph.nodes if n.op == "call_module"]
    stage_of = {n: i for i, n in enumerate(calls)}

    def source(value: torch.fx.Node) -> int:
        """The stage that computes ``value``; -1 for the model's own inputs."""
        while value.op == "call_function" and value.target is operator.getitem:
            value = value.args[0]
        return stage_of.get(value, -1)

    output = next(n for n in graph.nodes if n.op == "output")
    if any(source(v) != len(calls) - 1 for v in output.all_input_nodes):
        raise StageError("the model returns values computed before its last stage: pipeline stages need the outputs "
                         "to come from after the last block")
    receives = [[] for _ in calls]  # what each stage takes: its own inputs, then values it passes on
    for k in reversed(range(len(calls))):
        own = list(calls[k].args)
        if calls[k].kwargs or not all(isinstance(a, torch.fx.Node) for a in own):
            raise StageError(f"stage {k} takes keyword or constant inputs, which pipelining cannot send")
        later = receives[k + 1] if k + 1 < len(calls) else []
        receives[k] = own + [v for v in later if source(v) < k and v not in own]
    missing = [v.name for v in receives[0][len(calls[0].args):]]
    if missing:
        raise StageError(f"a later stage reads the model inputs {missing} that the first stage does not: "
                         "pipelining sends inputs to the first stage only")
    modules = [pipe.get_stage_module(k) for k in range(len(calls))]
    for k in range(len(calls) - 1):
        _pass_on(modules[k], calls[k], receives[k], receives[k + 1], [source(v) == k for v in receives[k + 1]])
    return modules


def _pass_on(module: torch.fx.GraphModule, call: torch.fx.Node, takes: list, returns: list, own: list) -> None:
    """Give ``module`` a placeholder for each value in ``takes`` beyond its own inputs and make it return
    ``returns``: its own outputs (``own``) or values it took."""
    g = module.graph
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    for value in takes[len(placeholders):]:
        with g.inserting_after(placeholders[-1]):
            placeholders.append(g.placeholder(value.name))
    inner = dict(zip(takes, placeholders, strict=True))
    out_node = next(n for n in g.nodes if n.op == "output")
    produced = out_node.args[0]

    def computed(value: torch.fx.Node):
        return produced if value is call else produced[value.args[1]]  # the whole output, or one getitem of it

    out_node.args = (tuple(computed(v) if mine else inner[v] for v, mine in zip(returns, own, strict=True)),)
    g.lint()
    module.recompile()
