"""One graph under every option: ``torch.compile(sharded, fullgraph=True)`` with inductor on the CPU compiles
the sharded program without a break and trains exactly as one process does, over 3 steps, on 2 gloo ranks.
Compiles are slow on the CPU: the default tier runs sequence parallelism, the other options are in the slow tier."""

from __future__ import annotations

import torch

import autotp
from tests.helpers.compiled import compiled_training_matches
from tests.helpers.distributed import run_ranks
from tests.helpers.models import llama_with


def _tokens() -> tuple:
    return (torch.randint(0, 96, (2, 8)),)


def _sequence_parallel(rank: int, world: int) -> None:
    model = llama_with(heads=4, kv=2, head_dim=8, layers=1)
    sharded = autotp.parallelize(model, _tokens(), sequence_parallel=True)
    assert any(c["op"] == "reduce_scatter" for c in sharded.autotp_plan.collectives)
    torch.manual_seed(1)
    compiled_training_matches(model, sharded, _tokens)


def test_sequence_parallel_compiles_as_one_graph_and_trains_exactly():
    run_ranks(2, _sequence_parallel)
