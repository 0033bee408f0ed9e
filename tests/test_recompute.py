"""Selective recomputation of the attention core (Korthikanti et al. 2022 §5): the sharded program
computes the scores again in the backward instead of keeping them.  Exact against one process, with
and without sequence parallelism; what autograd keeps is what the plan estimates; taken only when
tensor and sequence parallelism alone do not fit."""

from __future__ import annotations

import re

import pytest
import torch

import autotp
from autotp.ops.strategies import needs_grad
from autotp.options import PlanOptions
from autotp.passes.prepared_graph import prepared_graph
from autotp.passes.recompute import attention_cores
from autotp.planning.tensor_plan import solve_plan
from autotp.runtime.activations import Recomputed
from autotp.tools.spawn import run_local
from tests.helpers import configs
from tests.helpers.activations import saved_bytes
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL
from tests.helpers.models import build, example_input, logits
from tests.helpers.sequence_parallel import EXAMPLE, matches_one_process
from tests.helpers.training import STEPS, adamw, batch, llama, token_loss, trained_in_one_process

aten = torch.ops.aten


# LLaMA: the core is one SDPA op; GPT-2 eager: QK^T, scale, mask, softmax, ·V materialized
TWO_RANKS = (("llama", "sdpa", False), ("gpt2", "eager", True))


def _with_attention(kind: str, attention: str) -> tuple:
    model, _, blocks = build(kind)
    model.set_attn_implementation(attention)
    return model, blocks


def _two_ranks_models() -> list:
    return [(_with_attention(kind, attention)[0], (torch.randint(0, 96, EXAMPLE),)) for kind, attention, _ in TWO_RANKS]


def _two_ranks(rank: int, world: int) -> None:
    for kind, attention, tokens in TWO_RANKS:
        model, blocks = _with_attention(kind, attention)
        example = torch.randint(0, 96, EXAMPLE)
        sharded = autotp.parallelize(model, (example,), sequence_parallel=tokens, recompute="selective")
        plan = sharded.autotp_plan
        assert len(plan.cost["recompute"]) == blocks, plan.cost["recompute"]
        assert sum(isinstance(m, Recomputed) for m in sharded.modules()) == blocks
        matches_one_process(model, sharded, [(2, 11), (1, 1)], plan)
        estimate = plan.cost["memory"]["activations"]
        assert saved_bytes(sharded, example) == pytest.approx(estimate, rel=0.10), kind
        if attention == "eager" and tokens:  # dropping the scores is what it is for
            kept = autotp.plan(model, (example,), world_size=2, sequence_parallel=True, recompute=False)
            assert estimate < 0.8 * kept.cost["memory"]["activations"]


def test_recomputed_attention_is_exact_at_two_ranks():
    run_ranks(2, _two_ranks, captures=_two_ranks_models)


def test_taken_only_when_sequence_parallelism_does_not_fit():
    """A GPT-2 with materialized scores at 4 x 2048 tokens: plenty of memory, no recomputation; under a
    limit that tensor plus sequence parallelism exceeds, the attention cores are recomputed."""
    from rich.console import Console
    from transformers import GPT2LMHeadModel

    from autotp.tools.report import activations_table

    config = configs.gpt2(
        n_layer=1,
        n_embd=256,
        n_head=8,
        n_positions=2048,
        vocab_size=512,
        activation_function="gelu",
        attn_implementation="eager",
        use_cache=True,
    )
    with torch.device("meta"):
        model = GPT2LMHeadModel(config).eval()
    gm = prepared_graph(model, (torch.zeros(4, 2048, dtype=torch.long, device="meta"),), None)
    (core,) = attention_cores(gm, needs_grad(gm))  # one block: QK^T, scale, mask, softmax, ·V
    assert [n.target for n in core if n.target in (aten.matmul.default, aten.softmax.int)] == [
        aten.matmul.default,
        aten.softmax.int,
        aten.matmul.default,
    ]
    mlp, mlp_args, _ = build("mlp")
    plain = prepared_graph(mlp, mlp_args, None)
    assert attention_cores(plain, needs_grad(plain)) == []  # no softmax between products: nothing to recompute
    split = solve_plan(gm, 2, PlanOptions(sequence_parallel=True, recompute=False))
    again = solve_plan(gm, 2, PlanOptions(sequence_parallel=True, recompute="selective"))
    assert again.cost["memory"]["total"] < split.cost["memory"]["total"]
    assert again.cost["seconds"] > split.cost["seconds"]  # the core's forward, run twice
    assert not solve_plan(gm, 2, PlanOptions()).cost["recompute"]  # plenty of memory
    limit = (split.cost["memory"]["total"] + again.cost["memory"]["total"]) / 2
    tight = solve_plan(gm, 2, PlanOptions(memory_limit=limit))
    assert tight.cost["recompute"] == ["transformer.h.0.attn"] and tight.cost["memory"]["total"] <= limit
    assert any(entry.get("recompute") for entry in tight.nodes.values())
    # just above what both together need (the scores dominate here: recomputation alone nearly fits)
    tighter = solve_plan(gm, 2, PlanOptions(memory_limit=1.02 * again.cost["memory"]["total"]))
    assert tighter.cost["recompute"] and tighter.cost["token_split"]
    console = Console(width=200, record=True)
    console.print(activations_table(tighter))
    assert re.search(r"transformer\.h\.0 +│ +[\d.]+ +│ yes +│ attention", console.export_text()), console.export_text()
    with pytest.raises(ValueError, match="recompute"):
        solve_plan(gm, 2, PlanOptions(recompute=True))


def test_cli_plan_with_recomputation(capsys):
    import json

    from autotp.tools.cli import main

    assert main(["plan", "examples.nanogpt:build", "--world-size", "2", "--recompute", "selective", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["cost"]["recompute"] and not plan["cost"]["token_split"]


def _pipelined(rank: int, world: int, want: tuple) -> int:
    """PP 2 x TP 2 through parallelize(mesh=...): each stage's plan recomputes its attention cores, the
    stage's backward runs each core again once per micro-batch, and training equals one process."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    x, y = batch()
    pipelined = autotp.parallelize(llama(), (x,), mesh=mesh, loss_fn=token_loss, microbatches=2, recompute="selective")
    again = []
    for stage in pipelined.modules.values():
        cores = [m for m in stage.modules() if isinstance(m, Recomputed)]
        assert cores and len(cores) == len(stage.autotp_plan.cost["recompute"]), stage.autotp_plan.cost["recompute"]
        for core in cores:
            forward = core.region.forward

            def counted(*args, forward=forward):
                again.append(torch._C._current_autograd_node() is not None)  # run by the backward
                return forward(*args)

            core.region.forward = counted
    optimizer, losses = adamw(pipelined.parameters()), []
    for step in range(STEPS):
        per_microbatch = []
        pipelined.step(x, target=y, losses=per_microbatch)
        optimizer.step()
        optimizer.zero_grad()
        losses += [torch.stack(per_microbatch).mean().item()] if per_microbatch else []
        if step == 0:  # the first also runs pipelining's shape inference
            again.clear()
    assert sum(again) == 2 * len(cores) * (STEPS - 1), again  # each core again in the backward, per micro-batch
    want_losses, want_params = want
    if losses:  # the last stage
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), **TOL)
    params = pipelined.full_state_dict()
    for name, value in want_params.items():
        torch.testing.assert_close(params[name], torch.from_numpy(value), **TOL, msg=name)
    return len(losses)


def test_pipeline_stages_recompute_their_attention():
    reported = run_local(4, _pipelined, trained_in_one_process())
    assert reported == [0, 0, STEPS, STEPS], reported  # the last stage's two TP ranks compared every step's loss


def _compiled(rank: int, world: int) -> None:
    """GPT-2 with materialized scores, sequence parallel, attention recomputed: torch.compile of the sharded
    program (checkpointed cores; gathered tokens, which compiled code keeps as its compiler decides)."""
    model, args, _ = build("gpt2")
    model.set_attn_implementation("eager")
    sharded = autotp.parallelize(model, args, sequence_parallel=True, recompute="selective")
    assert any(isinstance(m, Recomputed) for m in sharded.modules())
    compiled = torch.compile(sharded, backend="aot_eager")  # inductor works too, at many times the compile time
    x = example_input("gpt2", 3, 5)
    out = logits(compiled(x))
    torch.testing.assert_close(out, logits(model(x)), **TOL)
    out.square().mean().backward()
    logits(model(x)).square().mean().backward()
    grads = autotp.full_state_dict(sharded, grads=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow  # torch.compile of the sharded program: test_sharded.py
def test_torch_compile_of_recomputed_attention():
    run_ranks(2, _compiled)
