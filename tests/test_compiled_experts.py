"""Every expert strategy under one graph: ``torch.compile(sharded, fullgraph=True)`` with inductor on the CPU
compiles a 1-block Mixtral with its experts split ("tensor"), dealt whole ("parallel") or sent their rows by
all-to-all, and trains exactly as one process does over 3 steps on 2 gloo ranks.  The graph reads sizes from
the device at most once a MoE layer: all-to-all reads its splits once (autotp turns on dynamo's
``capture_scalar_outputs``), the other strategies never.  Compiles are slow on the CPU: slow tier (the default
tier compiles sequence parallelism, tests/test_compiled.py)."""

from __future__ import annotations

import operator

import pytest
import torch

import autotp
from tests.helpers.compiled import compiled_training_matches
from tests.helpers.distributed import run_ranks

LAYERS = 2


def _tokens() -> tuple:
    return (torch.randint(0, 96, (2, 8)),)


def host_reads(graph: torch.fx.GraphModule) -> int:
    """Tensors of ``graph`` (dynamo's) whose values become Python numbers: ``t.tolist()`` is one read of t (an
    ``item`` of each element), ``t.item()`` one read."""
    read = set()
    for node in graph.graph.nodes:
        if node.op == "call_method" and node.target in ("item", "tolist"):
            (source,) = node.args[:1]
            if source.op == "call_function" and source.target is operator.getitem:
                source = source.args[0]
            read.add(source)
    return len(read)


def _experts(rank: int, world: int, experts: str) -> int:
    """A ``LAYERS``-block Mixtral, its experts placed by ``experts``; the host reads of its compiled forward."""
    from torch._inductor.compile_fx import compile_fx

    from tests.helpers.moe import mixtral

    model = mixtral(layers=LAYERS)
    sharded = autotp.parallelize(model, _tokens(), experts=experts)
    graphs: list = []

    def inductor(graph, example_inputs):
        graphs.append(graph)
        return compile_fx(graph, example_inputs)

    torch.manual_seed(1)
    compiled_training_matches(model, sharded, _tokens, backend=inductor)
    assert len(graphs) == 1, graphs  # one shape, one graph: no recompile
    return host_reads(graphs[0])


@pytest.mark.slow  # the default tier compiles sequence parallelism (tests/test_compiled.py)
@pytest.mark.parametrize(("experts", "reads_a_layer"), [("tensor", 0), ("parallel", 0), ("all-to-all", 1)])
def test_every_expert_strategy_compiles_as_one_graph_and_trains_exactly(experts, reads_a_layer):
    assert run_ranks(2, _experts, experts) == [reads_a_layer * LAYERS] * 2
