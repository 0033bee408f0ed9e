"""Selective recomputation of the attention core (Korthikanti et al. 2022 §5): the sharded program
computes the scores again in the backward instead of keeping them.  Exact against one process, with
and without sequence parallelism; what autograd keeps is what the plan estimates; taken only when
tensor and sequence parallelism alone do not fit."""
from __future__ import annotations

import re

import pytest
import torch
from test_activations import saved_bytes
from test_sequence_parallel import EXAMPLE, _exact

import autotp
from autotp.api import _graph, _solve
from autotp.passes.recompute import attention_cores
from autotp.passes.strategies import needs_grad
from autotp.runtime.recompute import Recomputed
from distributed import run_ranks
from models import build

aten = torch.ops.aten


def _two_ranks(rank: int, world: int) -> None:
    # LLaMA: the core is one SDPA op; GPT-2 eager: QK^T, scale, mask, softmax, ·V materialized
    for kind, attention, tokens in (("llama", "sdpa", False), ("gpt2", "eager", True)):
        model, _, blocks = build(kind)
        model.set_attn_implementation(attention)
        example = torch.randint(0, 96, EXAMPLE)
        sharded = autotp.parallelize(model, (example,), sequence_parallel=tokens, recompute="selective")
        plan = sharded.autotp_plan
        assert len(plan.cost["recompute"]) == blocks, plan.cost["recompute"]
        assert sum(isinstance(m, Recomputed) for m in sharded.modules()) == blocks
        _exact(model, sharded, [(2, 11), (1, 1)], plan)
        estimate = plan.cost["memory"]["activations"]
        assert saved_bytes(sharded, example) == pytest.approx(estimate, rel=0.10), kind
        if attention == "eager" and tokens:  # dropping the scores is what it is for
            kept = autotp.plan(model, (example,), world_size=2, sequence_parallel=True, recompute=False)
            assert estimate < 0.8 * kept.cost["memory"]["activations"]


def test_recomputed_attention_is_exact_at_two_ranks():
    run_ranks(2, _two_ranks)


def test_taken_only_when_sequence_parallelism_does_not_fit():
    """A GPT-2 with materialized scores at 4 x 2048 tokens: plenty of memory, no recomputation; under a
    limit that tensor plus sequence parallelism exceeds, the attention cores are recomputed."""
    from rich.console import Console
    from transformers import GPT2Config, GPT2LMHeadModel

    from autotp.tools.report import activations_table
    config = GPT2Config(n_layer=1, n_embd=256, n_head=8, n_positions=2048, vocab_size=512, activation_function="gelu",
                        attn_implementation="eager")
    with torch.device("meta"):
        model = GPT2LMHeadModel(config).eval()
    gm = _graph(model, (torch.zeros(4, 2048, dtype=torch.long, device="meta"),), None)
    core, = attention_cores(gm, needs_grad(gm))  # one block: QK^T, scale, mask, softmax, ·V
    assert [n.target for n in core if n.target in (aten.matmul.default, aten.softmax.int)] == [
        aten.matmul.default, aten.softmax.int, aten.matmul.default]
    mlp, mlp_args, _ = build("mlp")
    plain = _graph(mlp, mlp_args, None)
    assert attention_cores(plain, needs_grad(plain)) == []  # no softmax between products: nothing to recompute
    split = _solve(gm, 2, None, sequence_parallel=True, recompute=False)
    again = _solve(gm, 2, None, sequence_parallel=True, recompute="selective")
    assert again.cost["memory"]["total"] < split.cost["memory"]["total"]
    assert again.cost["seconds"] > split.cost["seconds"]  # the core's forward, run twice
    assert not _solve(gm, 2, None).cost["recompute"]  # plenty of memory
    limit = (split.cost["memory"]["total"] + again.cost["memory"]["total"]) / 2
    tight = _solve(gm, 2, None, memory_limit=limit)
    assert tight.cost["recompute"] == ["transformer.h.0.attn"] and tight.cost["memory"]["total"] <= limit
    assert any(entry.get("recompute") for entry in tight.nodes.values())
    # just above what both together need (the scores dominate here: recomputation alone nearly fits)
    tighter = _solve(gm, 2, None, memory_limit=1.02 * again.cost["memory"]["total"])
    assert tighter.cost["recompute"] and tighter.cost["token_split"]
    console = Console(width=200, record=True)
    console.print(activations_table(tighter))
    assert re.search(r"transformer\.h\.0 +│ +[\d.]+ +│ yes +│ attention", console.export_text()), console.export_text()
    with pytest.raises(ValueError, match="recompute"):
        _solve(gm, 2, None, recompute=True)


def test_cli_plan_with_recomputation(capsys):
    import json

    from autotp.tools.cli import main
    assert main(["plan", "examples.nanogpt:build", "--world-size", "2", "--recompute", "selective", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["cost"]["recompute"] and not plan["cost"]["token_split"]
