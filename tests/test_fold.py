"""Folded planning (passes/fold.py): a stack of identical blocks planned from four of them gives the
whole-graph plan, runs exactly, and is refused or skipped where the blocks are not alike."""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.passes.capture import fingerprint
from autotp.passes.prepared_graph import prepared_graph
from autotp.plan import Plan, PlanMismatch
from autotp.planning.plan_choice import plan_choice
from tests.helpers import configs
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL
from tests.helpers.models import build, example_input, logits


class Block(torch.nn.Module):
    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.up, self.down, self.scale = torch.nn.Linear(32, 128), torch.nn.Linear(128, 32), scale

    def forward(self, x, double: bool = False):
        y = self.down(torch.relu(self.up(x))) * self.scale
        return x + (2 * y if double else y)


class Stack(torch.nn.Module):
    """Six residual MLP blocks; ``odd`` makes block 3 differ, ``how`` says how the forward visits them."""

    def __init__(self, odd: str = "", how: str = "iterate"):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block(0.5 if odd == "setting" and i == 3 else 1.0) for i in range(6))
        self.odd, self.how = odd, how

    def forward(self, x):
        if self.how == "index":
            for i in range(len(self.blocks)):
                x = self.blocks[i](x)
            return x
        if self.how == "reversed":
            for block in list(self.blocks)[::-1]:
                x = block(x)
            return x
        for i, block in enumerate(self.blocks):  # "position": the fourth block visited is doubled
            x = block(x, double=self.odd == "position" and i == 3)
        return x


def _stamped(model, args, world: int) -> tuple[Plan, Plan, dict, dict]:
    """The folded and whole-graph plans, each applied to the whole graph (node -> strategy)."""
    folded = autotp.plan(model, args, world_size=world)
    whole = autotp.plan(model, args, world_size=world, fold=False)
    gm = prepared_graph(model, args, None)
    by_name = lambda choice: {n.name: s for n, s in choice.items()}  # noqa: E731
    return (
        folded,
        whole,
        by_name(plan_choice(gm, Plan.from_json(folded.to_json()), fingerprint(gm), world)),
        by_name(plan_choice(gm, whole, fingerprint(gm), world)),
    )


@pytest.mark.parametrize(
    "kind,blocks,world",
    [
        pytest.param("llama", 6, 2, marks=pytest.mark.slow),
        ("gpt2", 5, 4),
        pytest.param("phi3", 7, 3, marks=pytest.mark.slow),
        ("stack", 6, 2),
    ],
)
def test_folded_plan_is_the_whole_graph_plan(kind, blocks, world):
    model, args = (Stack(), (torch.randn(2, 4, 32),)) if kind == "stack" else build(kind, blocks=blocks)[:2]
    folded, whole, stamped, reference = _stamped(model, args, world)
    assert folded.fold is not None and folded.fold["count"] == blocks and whole.fold is None
    assert len(folded.nodes) < len(whole.nodes)  # four blocks were planned, not all of them
    assert stamped == reference  # every op of every block: same input and output placements
    assert folded.params == whole.params and folded.styles == whole.styles
    assert folded.cost["seconds"] == pytest.approx(whole.cost["seconds"], rel=1e-9)
    assert folded.cost["memory"] == pytest.approx(whole.cost["memory"], rel=1e-9)
    assert folded.collective_counts("forward") == whole.collective_counts("forward")
    assert folded.collective_counts("backward") == whole.collective_counts("backward")


def test_blocks_with_different_settings_are_not_folded():
    plan = autotp.plan(Stack(odd="setting"), (torch.randn(2, 4, 32),), world_size=2)
    assert plan.fold is None and "blocks.3.up.weight" in plan.params


@pytest.mark.parametrize("how", ["index", "reversed"])
def test_a_forward_that_indexes_or_reverses_the_blocks_is_planned_whole(how):
    model, args = Stack(how=how), (torch.randn(2, 4, 32),)
    folded, _, stamped, reference = _stamped(model, args, 2)
    assert folded.fold is None and stamped == reference


def test_a_folded_plan_is_refused_where_a_middle_block_differs_in_the_graph():
    model, args = Stack(odd="position"), (torch.randn(2, 4, 32),)
    plan = autotp.plan(model, args, world_size=2)  # the four kept blocks look alike ...
    assert plan.fold is not None
    gm = prepared_graph(model, args, None)  # ... the whole graph shows block 3 computing something else
    with pytest.raises(PlanMismatch, match=r"blocks\.3 computes something different.*fold=False"):
        plan_choice(gm, plan, fingerprint(gm), 2)


def _run_folded(rank: int, world: int, plan_json: str) -> None:
    model, args, _ = build("llama", blocks=5)
    sharded = autotp.parallelize(model, args, plan=Plan.from_json(plan_json))
    torch.manual_seed(1)
    for batch, seq in [(3, 5), (1, 1)]:
        x = example_input("llama", batch, seq)
        torch.testing.assert_close(logits(sharded(x)), logits(model(x)), **TOL)
    x = example_input("llama", 2, 6)
    logits(sharded(x)).square().mean().backward()
    logits(model(x)).square().mean().backward()
    grads = autotp.full_state_dict(sharded, grads=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_folded_plan_runs_exactly_on_two_ranks():
    model, args, _ = build("llama", blocks=5)
    plan = autotp.plan(model, args, world_size=2)
    assert plan.fold == {"path": "model.layers", "count": 5}
    run_ranks(2, _run_folded, plan.to_json())


@pytest.mark.slow
def test_moe_blocks_reading_a_size_computed_once_are_folded():
    """Mixtral's experts read tokens x top-k, which export computes once in block 0 and every block reads: a size,
    the same in each block (it used to keep the stack from folding, so MoE models could not be pipelined)."""
    from transformers import MixtralForCausalLM

    torch.manual_seed(0)
    config = configs.mixtral(num_hidden_layers=6)
    folded, whole, stamped, reference = _stamped(MixtralForCausalLM(config).eval(), (torch.randint(0, 96, (2, 8)),), 2)
    assert folded.fold is not None and folded.fold["count"] == 6 and whole.fold is None
    assert stamped == reference and folded.params == whole.params
    assert folded.cost["seconds"] == pytest.approx(whole.cost["seconds"], rel=1e-9)


@pytest.mark.slow
def test_a_run_of_identical_blocks_after_different_ones_is_folded():
    """DeepSeek-V3's first layers have a dense MLP, the rest experts: the dense ones are kept whole and the run of
    MoE blocks after them folded; the plan is the whole graph's, op by op."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = configs.deepseek_v3(num_hidden_layers=6, n_group=2, topk_group=1)
    model = DeepseekV3ForCausalLM(config).eval()
    folded, whole, stamped, reference = _stamped(model, (torch.randint(0, 96, (2, 8)),), 2)
    assert folded.fold == {"path": "model.layers", "count": 6, "start": 1}
    assert len(folded.nodes) < len(whole.nodes) and stamped == reference and folded.params == whole.params
    assert folded.cost["seconds"] == pytest.approx(whole.cost["seconds"], rel=1e-9)
