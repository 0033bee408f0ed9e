"""Sequence parallelism (Korthikanti et al. 2022): norms, dropouts and residual adds split by tokens
between the tensor-parallel regions, all-gathered before the column-parallel matmuls and
reduce-scattered after the row-parallel ones.  Exact against one process, uneven lengths included;
Megatron-SP's forward communication per block; activation memory measured with saved-tensor hooks."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

import autotp
from tests.helpers import configs, training
from tests.helpers.activations import saved_bytes
from tests.helpers.distributed import block_of, run_ranks
from tests.helpers.models import build, vit
from tests.helpers.sequence_parallel import EXAMPLE, matches_one_process, regather_limits

BLOCKS = 2


def _two_ranks_models() -> list:
    return [(build(kind, blocks=BLOCKS)[0], (torch.randint(0, 96, EXAMPLE),)) for kind in ("llama", "gpt2")]


def _two_ranks(rank: int, world: int, tight: float) -> None:
    for kind, limit in (("llama", None), ("gpt2", None), ("llama", tight)):
        model, _, _ = build(kind, blocks=BLOCKS)
        example = torch.randint(0, 96, EXAMPLE)
        bound = {"memory_limit": limit, "recompute": False} if limit else {}
        sharded = autotp.parallelize(model, (example,), sequence_parallel=True, **bound)
        plan = sharded.autotp_plan
        # gathered tokens are kept whole for the backward where memory allows; under the limit some are kept as
        # this rank's piece and gathered again (the backward's all-gathers counted below), the others whole
        gathered = {name: entry["regather"] for name, entry in plan.nodes.items() if "regather" in entry}
        assert set(gathered.values()) == ({False, True} if limit else {False}), (kind, gathered)
        forward = [c for c in plan.collectives if c["phase"] == "forward"]
        per_block = {b: Counter(c["op"] for c in forward if block_of(c["module"]) == b) for b in range(BLOCKS)}
        assert all(ops == {"all_gather": 2, "reduce_scatter": 2} for ops in per_block.values()), (kind, per_block)
        backward = matches_one_process(model, sharded, [(2, 11), (1, 1), (3, 5)], plan)
        # the norms' weights and biases (and the biases added to token pieces) in one all-reduce, as Megatron-SP
        assert backward.get("all_reduce") == 1, (kind, backward)

        # what autograd keeps is what the plan estimates, with and without sequence parallelism
        programs = [sharded]
        if kind == "gpt2" and not limit:  # dropout, GELU, layer norm, materialized attention scores
            programs.append(autotp.parallelize(model, (example,), sequence_parallel=False))
            plain = programs[-1].autotp_plan
            assert not any(c["op"] == "reduce_scatter" for c in plain.collectives)
            assert plan.cost["memory"]["activations"] < plain.cost["memory"]["activations"]
        for program in programs:
            estimate = program.autotp_plan.cost["memory"]["activations"]
            assert saved_bytes(program, example) == pytest.approx(estimate, rel=0.10), kind


def test_sequence_parallel_at_two_ranks_is_exact_with_megatrons_collectives():
    model, args = _two_ranks_models()[0]
    whole, pieces = regather_limits(model, args)
    run_ranks(2, _two_ranks, (whole + pieces) / 2, captures=_two_ranks_models)


def _eleven_tokens_models() -> list:
    return [(build("llama", blocks=1)[0], (torch.randint(0, 96, (2, 16)),))]


def _eleven_tokens(rank: int, world: int) -> None:
    model, _, _ = build("llama", blocks=1)
    sharded = autotp.parallelize(model, (torch.randint(0, 96, (2, 16)),), sequence_parallel=True)
    matches_one_process(model, sharded, [(1, 11), (2, 3)])  # 3,3,3,2 tokens; 1,1,1,0


def test_eleven_tokens_on_four_ranks():
    run_ranks(4, _eleven_tokens, captures=_eleven_tokens_models)


def test_fsdp2_units_per_block_with_sequence_parallelism_train_exactly():
    """TP 2 x DP 2: each block an FSDP2 unit under sequence parallelism too (the norm weights' gradient sum, one
    for the model without units, is made one per block so that each unit owns its parameters' reads)."""
    reference = training.trained_in_one_process(lambda: training.llama(layers=2))
    run_ranks(4, training.tp_dp_matches, reference, True, False)


def test_taken_where_cheaper_or_where_memory_demands_it():
    """A GPT-2 (layer norms: the residual stream cannot be split by hidden instead) at 4 x 4096 tokens: plain
    tensor parallelism is the cheaper plan there, so the default takes it; under a limit it exceeds the tokens are
    split.  (Where splitting is cheaper, LLaMA-3 8B at 2,048 tokens, the default plan is no dearer than Megatron's
    with it: tests/test_hand_plans.py.)"""
    from rich.console import Console
    from transformers import GPT2LMHeadModel

    from autotp.tools.report import activations_table

    config = configs.gpt2(
        n_layer=1, n_embd=256, n_head=8, n_positions=4096, vocab_size=512, activation_function="gelu", use_cache=True
    )
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    args = (torch.zeros(4, 4096, dtype=torch.long, device="meta"),)
    plain = autotp.plan(model, args, world_size=2, sequence_parallel=False)
    split = autotp.plan(model, args, world_size=2, sequence_parallel=True)
    assert split.cost["memory"]["total"] < plain.cost["memory"]["total"]

    def ops(plan):
        return {c["op"] for c in plan.collectives if c["phase"] == "forward"}

    assert split.cost["seconds"] > plain.cost["seconds"]
    assert "reduce_scatter" not in ops(autotp.plan(model, args, world_size=2))  # plenty of memory: the cheaper
    limit = (plain.cost["memory"]["total"] + split.cost["memory"]["total"]) / 2
    tight = autotp.plan(model, args, world_size=2, memory_limit=limit)
    assert "reduce_scatter" in ops(tight) and tight.cost["memory"]["total"] <= limit
    # reports: bytes kept per module (summing to the memory estimate) and the modules that split the tokens
    assert sum(split.cost["activations"].values()) == pytest.approx(split.cost["memory"]["activations"])
    assert "transformer.h.0.ln_1" in split.cost["token_split"] and not plain.cost["token_split"]
    console = Console(width=200, record=True)
    console.print(activations_table(split))
    assert re.search(r"transformer\.h\.0 +│ +[\d.]+ +│ yes", console.export_text()), console.export_text()
    with pytest.raises(ValueError, match="sequence_parallel"):
        autotp.plan(model, args, world_size=2, sequence_parallel="yes")


def test_cli_plan_with_sequence_parallelism(capsys):
    import json

    from autotp.tools.cli import main

    assert main(["plan", "examples.nanogpt:build", "--world-size", "2", "--sequence-parallel", "on", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["cost"]["token_split"] and {"reduce_scatter", "all_gather"} <= {c["op"] for c in plan["collectives"]}


def test_forcing_it_without_a_token_dim_says_why():
    """A ViT's 17 tokens are fixed by its config (export makes them static): there is nothing to split."""
    from autotp.planning.solution import PlanningError

    with pytest.raises(PlanningError, match="no op can split the tokens"):
        autotp.plan(vit(), (torch.randn(1, 3, 16, 16),), world_size=2, sequence_parallel=True)


def test_gradients_of_gathered_tokens_are_reduce_scattered():
    """Megatron-SP's backward: what the forward all-gathers along tokens, the backward reduce-scatters; the
    only all-reduces left sum parameter gradients (norms, biases added to token pieces).  GPT-2's Conv1D
    flattens tokens into rows before its product (view, mm, view): planned on the unflattened input."""
    for kind in ("llama", "gpt2"):
        model, _, _ = build(kind, blocks=BLOCKS)
        plan = autotp.plan(model, (torch.randint(0, 96, EXAMPLE),), world_size=2, sequence_parallel=True)
        params = {name.replace(".", "_") for name in plan.shapes}
        summed = [
            c["tensor"]
            for c in plan.collectives
            if c["phase"] == "backward" and c["op"] == "all_reduce" and c["tensor"] not in params
        ]
        assert summed == [], f"{kind}: activation gradients all-reduced: {summed}"
        counts = plan.collective_counts("backward")
        assert counts["reduce_scatter"] >= 2 * BLOCKS, f"{kind}: {counts}"
        # every norm's weight (and bias) in the blocks has its partial gradients summed by one all-reduce
        norms = {
            name.replace(".", "_")
            for name, _ in model.named_parameters()
            if (".h." in name or ".layers." in name) and ("norm" in name or ".ln_" in name)
        }
        (together,) = [c for c in plan.collectives if c["phase"] == "backward" and c["op"] == "all_reduce"]
        assert norms <= set(together["tensors"]), (kind, together)


def _priced_as(plan, monkeypatch, model, args, options, **patches):
    """``plan`` (sequence parallel, 2 ranks, planned with ``options``) priced again by the solver with every op
    held to its choice and ``patches`` (name -> value) set in planning/ilp.py and planning/accounting.py; the
    alternatives are the full ones."""
    from dataclasses import replace

    from autotp.plan import Plan
    from autotp.planning import accounting, ilp
    from autotp.planning.solve import solve as plan_solve

    def held(gm, found, *a, **k):
        chosen = {
            n: [s for s in opts if Plan.encode(s) == {f: plan.nodes[n.name][f] for f in ("in", "out")}]
            for n, opts in found.strategies.items()
        }
        return plan_solve(gm, replace(found, strategies=chosen), *a, **k)

    with monkeypatch.context() as patch:
        patch.setattr("autotp.planning.tensor_plan.solve", held)
        for name, replacement in patches.items():
            for module in (ilp, accounting):
                if hasattr(module, name):
                    patch.setattr(module, name, replacement)
        return autotp.plan(model, args, world_size=2, sequence_parallel=True, **options)


def test_backward_collectives_of_sequence_parallelism_are_priced(monkeypatch):
    """Tokens a column-parallel matmul keeps as this rank's piece (where memory binds: the limit is that of the
    plan keeping every one so) are all-gathered again in its backward: the solver prices each such all-gather
    (plan.cost["regathers"]) as the plan lists it, and the step time
    (`autotp plan`) and each op's alternatives (`autotp explain`) include exactly that much.  The partial
    gradients of replicated parameters (norms) are summed in one all-reduce: priced with one latency."""
    from autotp.cost_models import collective_time, load_topology

    topology = load_topology(None)
    latency = collective_time("all_reduce", 0.0, 2, topology)
    for kind in ("llama", "gpt2"):
        model, _, _ = build(kind, blocks=BLOCKS)
        args = (torch.randint(0, 96, EXAMPLE),)
        options = {"memory_limit": regather_limits(model, args)[1], "recompute": False}
        plan = autotp.plan(model, args, world_size=2, sequence_parallel=True, **options)
        listed = sorted((c["tensor"], c["bytes"]) for c in plan.collectives if c.get("regather"))
        assert all(c["phase"] == "backward" and c["op"] == "all_gather" for c in plan.collectives if c.get("regather"))
        priced = plan.cost["regathers"]
        assert sorted((r["tensor"], r["bytes"]) for r in priced) == listed, kind
        assert len(listed) >= 2 * BLOCKS, (kind, listed)  # the attention's and the MLP's input, per block
        for r in priced:
            assert r["seconds"] == pytest.approx(collective_time("all_gather", r["bytes"], 2, topology))
        free = _priced_as(plan, monkeypatch, model, args, options, regather_time=lambda nbytes, world, topology: 0.0)
        assert not any(r["seconds"] for r in free.cost["regathers"])
        total = sum(r["seconds"] for r in priced)
        assert plan.cost["seconds"] - free.cost["seconds"] == pytest.approx(total, rel=1e-6)

        def chosen(p, name):
            return next(a["seconds"] for a in p.alternatives[name] if a["chosen"])

        for r in priced:  # the op that splits the tokens pays its tensor's re-gather among its alternatives
            assert chosen(plan, r["tensor"]) - chosen(free, r["tensor"]) == pytest.approx(r["seconds"], rel=1e-6)

        (together,) = [c for c in plan.collectives if c.get("tensors")]
        apart = _priced_as(plan, monkeypatch, model, args, options, coalesced=lambda src: False)  # an all-reduce each
        saved = (len(together["tensors"]) - 1) * latency
        assert apart.cost["seconds"] - plan.cost["seconds"] == pytest.approx(saved, rel=1e-6), kind


def test_a_plan_that_does_not_say_gathers_every_kept_token_again():
    """Plans written before the choice (no "regather" on their nodes) ran Megatron-SP's way: read back, every
    gathered token tensor a backward keeps is its piece gathered again, in the price and in the rewrite."""
    from autotp.options import PlanOptions
    from autotp.passes.capture import fingerprint
    from autotp.passes.prepared_graph import prepared_graph
    from autotp.plan import Plan
    from autotp.planning.plan_choice import planned
    from autotp.planning.tensor_plan import price_plan, solve_plan

    model, _, _ = build("llama", blocks=BLOCKS)
    gm = prepared_graph(model, (torch.randint(0, 96, EXAMPLE),), None, fold=False)
    plan = solve_plan(gm, 2, PlanOptions(sequence_parallel=True, recompute=False))
    gathered = {name for name, entry in plan.nodes.items() if "regather" in entry}
    assert gathered and not plan.cost["regathers"]
    older = Plan.from_json(plan.to_json())
    for entry in older.nodes.values():
        entry.pop("regather", None)
    assert {r["tensor"] for r in price_plan(gm, older).cost["regathers"]} == gathered
    read = planned(gm, Plan.from_json(older.to_json()), fingerprint(gm), 2).regathered
    assert gathered <= {node.name for node in read}
    assert not gathered & {node.name for node in planned(gm, plan, fingerprint(gm), 2).regathered}
