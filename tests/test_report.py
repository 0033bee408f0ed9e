"""What the command line's tables say beyond numbers: each rank's piece of a parameter (experts included), the
placement notation's legend beside the solver's alternatives."""

from __future__ import annotations

import io

import torch
from rich.console import Console

import autotp
from autotp.placement import NOTATION, parse
from autotp.runtime.hf_models import default_inputs
from autotp.tools.report import explain_table, local_shapes, plan_table, tensor_shapes
from tests.helpers import moe


def _text(table) -> str:
    console = Console(width=240, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text()


def test_uneven_heads_show_each_ranks_piece():
    """10 heads of 4 rows on 4 ranks: 3, 3, 2, 2 heads, each rank's rows as tensor_split deals them."""
    rows = [len(part) * 4 for part in torch.tensor_split(torch.arange(10), 4)]
    assert local_shapes(parse("S(0/10)"), (40, 8), 4) == f"{rows[0]}x8 on ranks 0-1, {rows[2]}x8 on ranks 2-3"
    assert local_shapes(parse("S(1)"), (40, 8), 4) == "40x2"


def test_expert_weights_show_the_experts_a_rank_holds(tmp_path):
    """Whole experts by all-to-all (A2(0)): a rank's piece is its experts, not the global tensor; the explain
    table's legend names every placement kind its rows use."""
    model = moe.mixtral(experts=4, layers=1)
    plan = autotp.plan(model, default_inputs(model), world_size=2, experts="all-to-all")
    text = _text(plan_table(plan, tensor_shapes(model), every=True))
    experts = {n: p for n, p in model.named_parameters() if n in moe.expert_params(model)}
    assert experts and all(str(plan.placement(n)).startswith("A2(0)") for n in experts)
    for name, param in experts.items():
        piece = torch.chunk(param, 2, dim=0)[0].shape
        row = next(line for line in text.splitlines() if f" {name} " in line)
        assert "x".join(map(str, piece)) in row and "x".join(map(str, param.shape)) not in row, row
    explained = _text(explain_table(plan, "model.layers.0.mlp.experts"))
    assert NOTATION.split(";")[0] in " ".join(explained.split())
