"""Asynchronous TP priced by the planner (planning/overlap.py): one LLaMA-3-8B-shaped block on the meta device,
priced at a long sequence on one DGX H100 (NVLink).  Rule and cost level: no ranks are spawned."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from rich.console import Console

from autotp.cost_models import communication
from autotp.options import PlanOptions
from autotp.passes.prepared_graph import prepared_graph
from autotp.plan import Plan
from autotp.planning.tensor_plan import price_plan, solve_plan
from autotp.tools.report import print_plan
from tests.helpers import configs

LONG = 16384  # tokens: 8 even pieces of 2048
UNEVEN = LONG - 1  # pieces of 2048 and 2047: padded


def _llama_block(tokens: int) -> torch.fx.GraphModule:
    from transformers import LlamaForCausalLM

    config = configs.llama(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=LONG,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return prepared_graph(model, (torch.zeros(2, tokens, dtype=torch.long, device="meta"),), None)


@pytest.fixture(scope="module")
def block():
    return _llama_block(256)


def _plan(gm, tokens: int, **options) -> Plan:
    return solve_plan(gm, 8, PlanOptions(topology="dgx-h100", price_at={"input_ids": (1, tokens)}, **options))


def test_the_planner_takes_sequence_parallelism_for_the_overlap_async_tp_buys(block):
    """Without overlap the unsplit plan is cheaper at this size; with the all-gathers and reduce-scatters fused
    into their matmuls (async_tp=None: the planner prices both), the split one is, and the planner says so.  The
    saving it reports is the difference to the same plan priced unfused."""
    plain = _plan(block, LONG, async_tp=False)
    chosen = _plan(block, LONG, async_tp=None)
    assert not plain.cost["token_split"] and not plain.cost["async_tp"]["chosen"]
    assert chosen.cost["token_split"] and chosen.cost["async_tp"]["chosen"]
    assert chosen.cost["seconds"] < plain.cost["seconds"]
    assert chosen.cost["async_tp"]["why"].startswith("priced:")
    fused = chosen.cost["async_tp"]["fused"]
    assert any(": S(1) -> R" in pair for pair in fused) and any(": P -> S(1)" in pair for pair in fused)
    unfused = Plan.from_json(chosen.to_json())
    unfused.cost["async_tp"]["chosen"] = False
    again = price_plan(block, unfused, PlanOptions(topology="dgx-h100", price_at={"input_ids": (1, LONG)}))
    saved = chosen.cost["async_tp"]["saved_seconds"]
    assert saved > 0
    assert again.cost["seconds"] - chosen.cost["seconds"] == pytest.approx(saved, rel=1e-6)
    Plan.from_json(chosen.to_json())  # the schema takes it
    console = Console(record=True, width=300)
    print_plan(chosen, console=console)
    assert f"asynchronous TP: on ({chosen.cost['async_tp']['why']}); {len(fused)} collective(s) fused" in (
        console.export_text()
    )


def test_an_uneven_token_split_is_priced_unfused(block):
    """Pieces of 2048 and 2047 tokens are padded, which the pass does not fuse: the same price as without."""
    fused = _plan(block, UNEVEN, async_tp=True, sequence_parallel=True)
    plain = _plan(block, UNEVEN, async_tp=False, sequence_parallel=True)
    assert fused.cost["async_tp"]["fused"] == [] and fused.cost["async_tp"]["saved_seconds"] == 0
    assert fused.cost["seconds"] == pytest.approx(plain.cost["seconds"], rel=1e-9)


def test_the_overlap_is_priced_by_fused_time(block, monkeypatch):
    """With fused_time standing for no overlap at all (the collective then the product), nothing is saved and the
    planner keeps the unsplit plan."""
    monkeypatch.setattr(
        communication, "fused_time", lambda collective_s, product_s, n, topology: collective_s + product_s
    )
    chosen = _plan(block, LONG, async_tp=None)
    assert not chosen.cost["token_split"] and not chosen.cost["async_tp"]["chosen"]
    assert chosen.cost["async_tp"]["saved_seconds"] == 0


def test_the_command_line_prices_asynchronous_tp_on_request():
    """``autotp plan --async-tp auto`` solves nanoGPT (one tensor gathered for several readers under several
    placements, each pair its own variable) and says what it chose and why."""
    from tests.helpers.cli import autotp

    result = autotp("plan", "examples.nanogpt:build", "--world-size", "2", "--async-tp", "auto")
    assert result.returncode == 0, result.stderr
    assert "asynchronous TP: off (priced: " in result.stdout


def test_the_mesh_planner_prices_asynchronous_tp():
    """plan_mesh (the block captured at the long sequence, whose shape it prices): with async_tp=None the TP-8
    layout runs sequence parallelism fused, faster than the unfused plan async_tp=False picks, and the same layout
    priced unfused costs what the overlap saved; the table and the choice line say so."""
    from autotp.planning.mesh_search import plan_mesh_for_graph, price_layout
    from autotp.tools.report import mesh_table

    stack = _llama_block(LONG)
    plain = plan_mesh_for_graph(stack, devices=8, topology="dgx-h100", async_tp=False)
    chosen = plan_mesh_for_graph(stack, devices=8, topology="dgx-h100", async_tp=None)
    assert (plain.choice.tp, plain.choice.sequence_parallel, plain.choice.async_tp) == (8, False, False)
    assert (chosen.choice.tp, chosen.choice.sequence_parallel, chosen.choice.async_tp) == (8, True, True)
    assert chosen.choice.step_seconds < plain.choice.step_seconds
    assert chosen.to_dict()["choice"]["async_tp"] is True
    unfused = price_layout(stack, replace(chosen.choice, async_tp=False), topology="dgx-h100")
    fused = price_layout(stack, chosen.choice, topology="dgx-h100")
    assert fused.step_seconds == pytest.approx(chosen.choice.step_seconds, rel=1e-9)
    assert unfused.step_seconds > fused.step_seconds
    console = Console(record=True, width=300)
    for part in mesh_table(chosen):
        console.print(part)
    text = console.export_text()
    assert "yes, async TP" in text and "sequence parallel with asynchronous TP" in text
