"""End to end on real gloo ranks: sharded outputs and gradients equal the single-process model's,
the plan is Megatron's, and the collectives run are the ones planned."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

import autotp
from tests.helpers.distributed import block_of, comm_counts, plan_ops, run_ranks, weight_collectives
from tests.helpers.exact import TOL
from tests.helpers.models import build, example_input, llama_with, logits

KINDS = ["mlp", "nanogpt", "llama", "gpt2", "phi3"]


def _built(kind: str) -> list:
    """The one model ``build(kind)`` gives the ranks, with its example inputs."""
    model, args, _ = build(kind)
    return [(model, args)]


def _check(rank: int, world: int, kind: str) -> None:
    model, args, blocks = build(kind)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params_before = [id(p) for p in model.parameters()]
    sharded = autotp.parallelize(model, args)

    # the user's model is untouched
    assert [id(p) for p in model.parameters()] == params_before
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k

    # names are kept, shapes are local, every 2-D weight inside a block holds 1/N of its elements
    full = dict(model.named_parameters())
    local = dict(sharded.named_parameters())
    assert local.keys() == full.keys()
    for name, p in local.items():
        assert isinstance(p, torch.nn.Parameter) and p.requires_grad
        if (p.dim() == 2 and block_of(name) is not None) or (kind == "mlp" and p.dim() == 2):
            assert p.numel() * world == full[name].numel(), (name, tuple(p.shape))

    # outputs for shapes other than traced, including batch 1 x sequence 1
    assert not weight_collectives(sharded), weight_collectives(sharded)  # weights are used where stored
    plan = sharded.autotp_plan
    forward_ops = plan.collective_counts("forward")
    torch.manual_seed(1)
    transport = autotp.runtime.transport
    one_shot, transport.ONE_SHOT_BYTES = transport.ONE_SHOT_BYTES, 0  # count all-reduces as such
    for batch, seq in [(3, 5), (1, 1)]:
        x = example_input(kind, batch, seq)
        with CommDebugMode() as comm:
            out = logits(sharded(x))
        torch.testing.assert_close(out, logits(model(x)), **TOL)
        assert plan_ops(comm_counts(comm)) == forward_ops, (comm_counts(comm), forward_ops)

    # Megatron: two all-reduces per transformer block forward (one for the MLP alone), plus at most two
    # collectives for the embedding and the head.  A vocab-parallel embedding's all-reduce may be
    # deferred into block 0 (it is summed where the first norm needs it), so a block may show one more.
    # Backward: Megatron's f before attention and before the MLP (two all-reduces a block), one before the head.
    per_block = {
        phase: Counter(
            block_of(c["module"]) for c in plan.collectives if c["phase"] == phase and c["op"] == "all_reduce"
        )
        for phase in ("forward", "backward")
    }
    if kind == "mlp":
        assert forward_ops["all_reduce"] == 1
    for block in range(blocks):
        assert per_block["forward"][block] in (2, 3), (block, per_block)
        assert per_block["backward"][block] == 2, (block, per_block)
    assert sum(forward_ops.values()) <= 2 * blocks + 2 or kind == "mlp", forward_ops
    backward_ops = plan.collective_counts("backward")
    assert sum(backward_ops.values()) <= 2 * blocks + 1, backward_ops

    # gradients equal the unsharded model's, running the backward collectives the plan predicts
    x = example_input(kind, 2, 6)
    loss = logits(sharded(x)).square().mean()
    with CommDebugMode() as comm:
        loss.backward()
    assert plan_ops(comm_counts(comm)) == backward_ops, (comm_counts(comm), backward_ops)
    transport.ONE_SHOT_BYTES = one_shot
    logits(model(x)).square().mean().backward()
    grads = autotp.full_state_dict(sharded, grads=True)
    weights = autotp.full_state_dict(sharded)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=0)


# every kind at 4 ranks; at 2 the MLP, the others in the slow tier
CASES = (
    [(kind, 4) for kind in KINDS]
    + [("mlp", 2)]
    + [pytest.param(kind, 2, marks=pytest.mark.slow) for kind in KINDS if kind != "mlp"]
)


@pytest.mark.parametrize(("kind", "world"), CASES)
def test_sharded_matches_single_process(kind, world):
    run_ranks(world, _check, kind, captures=functools.partial(_built, kind))


def test_ops_without_rules_see_full_tensors():
    run_ranks(2, _check, "unruly", captures=functools.partial(_built, "unruly"))


def _train_step(rank: int, world: int) -> None:
    """An optimizer with name-based param groups trains the sharded model like the original.

    SGD, not Adam: Adam divides by the gradient's own magnitude, so rounding-level differences in
    near-zero gradients become lr-sized steps and no tolerance separates bugs from noise."""
    model, args, _ = build("llama")
    sharded = autotp.parallelize(model, args)

    def groups(m):
        named = list(m.named_parameters())
        return [
            {"params": [p for n, p in named if "norm" not in n], "weight_decay": 0.1},
            {"params": [p for n, p in named if "norm" in n], "weight_decay": 0.0},
        ]

    opt_ref = torch.optim.SGD(groups(model), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(groups(sharded), lr=0.1, momentum=0.9)
    for _ in range(3):
        x = torch.randint(0, 128, (2, 7))
        for m, o in ((model, opt_ref), (sharded, opt)):
            o.zero_grad()
            logits(m(x)).float().logsumexp(-1).mean().backward()
            o.step()
    weights = autotp.full_state_dict(sharded)
    for name, p in model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), **TOL)


def test_training_steps_match():
    run_ranks(2, _train_step, captures=functools.partial(_built, "llama"))


def _given_plan(rank: int, world: int) -> None:
    """A plan made without a process group is applied as is; a plan for another world size is refused."""
    model, args, _ = build("gpt2")
    plan = autotp.plan(model, args, world_size=world)
    sharded = autotp.parallelize(model, args, plan=plan)
    x = example_input("gpt2", 2, 3)
    torch.testing.assert_close(logits(sharded(x)), logits(model(x)), **TOL)
    wrong = autotp.plan(model, args, world_size=world * 2)
    with pytest.raises(autotp.PlanMismatch, match=f"world size {world * 2}"):
        autotp.parallelize(model, args, plan=wrong)


def test_parallelize_with_a_given_plan():
    run_ranks(2, _given_plan, captures=functools.partial(_built, "gpt2"))


def _compiled(rank: int, world: int) -> None:
    model, args, _ = build("nanogpt")
    sharded = autotp.parallelize(model, args)
    compiled = torch.compile(sharded)  # functional collectives and autograd functions trace through
    torch.manual_seed(1)
    x = example_input("nanogpt", 3, 5)
    out = logits(compiled(x))
    torch.testing.assert_close(out, logits(model(x)), **TOL)
    out.square().mean().backward()
    logits(model(x)).square().mean().backward()
    grads = autotp.full_state_dict(sharded, grads=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow  # the default tier compiles a plan, fullgraph, in tests/test_compiled.py
def test_torch_compile_gives_the_same_outputs_and_gradients():
    run_ranks(2, _compiled, captures=functools.partial(_built, "nanogpt"))


# (head dim, batch, sequence) of 2-block LLaMAs the solver plans with a hidden-sharded residual stream:
# partial sums reduce-scattered forward, gathered inputs' gradients reduce-scattered backward
RESIDUAL_SHARDED = [(16, 8, 2048), (32, 4, 1024)]


def _residual_sharded_model(head_dim: int, batch: int, seq: int) -> tuple:
    """A 2-block LLaMA (the same seed every time) and the input shape its plan was made at."""
    return llama_with(heads=8, kv=4, head_dim=head_dim, layers=2), (torch.zeros(batch, seq, dtype=torch.long),)


def _residual_sharded_models() -> list:
    return [_residual_sharded_model(*sizes) for sizes in RESIDUAL_SHARDED]


def _runs_planned_collectives(rank: int, world: int, plans: list) -> None:
    transport = autotp.runtime.transport
    transport.ONE_SHOT_BYTES = 0  # count all-reduces as such
    for head_dim, batch, seq, plan in plans:
        model, args = _residual_sharded_model(head_dim, batch, seq)
        reference = llama_with(heads=8, kv=4, head_dim=head_dim, layers=2)  # same seed
        sharded = autotp.parallelize(model, args, plan=plan)
        x = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(1))
        with CommDebugMode() as forward:
            out = logits(sharded(x))
        with CommDebugMode() as backward:
            out.square().mean().backward()
        assert plan_ops(comm_counts(forward)) == plan.collective_counts("forward"), comm_counts(forward)
        assert plan_ops(comm_counts(backward)) == plan.collective_counts("backward"), comm_counts(backward)
        want = logits(reference(x))
        want.square().mean().backward()
        torch.testing.assert_close(out, want, **TOL)
        grads = autotp.full_state_dict(sharded, grads=True)
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_hidden_sharded_residual_runs_the_planned_reduce_scatters():
    """Plans made at thousands of tokens, run on a short input: the forward and backward collectives,
    reduce-scatters included, are the ones the plan predicts, and outputs and gradients are exact."""
    plans = []
    for head_dim, batch, seq in RESIDUAL_SHARDED:
        model = llama_with(heads=8, kv=4, head_dim=head_dim, layers=2)  # captured with fake tensors: never run
        plan = autotp.plan(model, (torch.zeros(batch, seq, dtype=torch.long),), world_size=2)
        plans.append((head_dim, batch, seq, plan))
    planned = {(c["phase"], c["op"]) for *_, plan in plans for c in plan.collectives}
    assert {("forward", "reduce_scatter"), ("backward", "reduce_scatter")} <= planned, (
        f"no reduce-scatter planned at these sizes any more ({planned}): pick sizes in RESIDUAL_SHARDED where the "
        "solver shards the residual stream by hidden"
    )
    run_ranks(2, _runs_planned_collectives, plans, captures=_residual_sharded_models)


def _poisoned() -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(96, 32), torch.nn.Linear(32, 64))  # rows 48..95 on rank 1
    with torch.no_grad():
        model[0].weight[48] = float("inf")
        model[0].weight[95] = float("nan")
    return model, (torch.randint(0, 48, (2, 5)),)


def _poisoned_models() -> list:
    return [_poisoned()]


def _poisoned_rows(rank: int, world: int) -> None:
    """An Inf and a NaN in rows no input reads: the vocab-parallel lookup must not leak them into the
    ranks that hold those rows but look up nothing there (0 x Inf is NaN; masking is exact)."""
    from autotp.placement import Shard

    model, (x,) = _poisoned()
    sharded = autotp.parallelize(model, (x,), fixed={"0.weight": Shard(0)})
    assert sharded.autotp_plan.params["0.weight"] == "S(0)"
    torch.testing.assert_close(sharded(x), model(x), **TOL)
    sharded(x).sum().backward()
    model(x).sum().backward()
    torch.testing.assert_close(autotp.full_state_dict(sharded, grads=True)["0.weight"], model[0].weight.grad, **TOL)


def test_vocab_parallel_embedding_never_reads_other_ranks_rows():
    run_ranks(2, _poisoned_rows, captures=_poisoned_models)


class _ReadTwice(torch.nn.Module):
    """The embedding, split by hidden dim, read whole both by a column-split projection (a sharded op: its
    gradient comes back as partial sums) and by an op without a sharding rule (cumprod: replicated)."""

    def __init__(self, vocab: int = 64, hidden: int = 48):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.up = torch.nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = torch.nn.Linear(4 * hidden, hidden, bias=False)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        return self.head(self.down(torch.nn.functional.gelu(self.up(x))) + torch.cumprod(1 + x / 64, -1))


def _read_twice() -> tuple:
    torch.manual_seed(0)
    return _ReadTwice(), (torch.randint(0, 64, (2, 7)),)


def _read_twice_models() -> list:
    return [_read_twice()]


def _gathered_once(rank: int, world: int) -> None:
    from autotp.placement import Shard

    model, (ids,) = _read_twice()
    sharded = autotp.parallelize(model, (ids,), fixed={"emb.weight": Shard(1), "up.weight": Shard(0)})
    gathers = [n for n in sharded.graph.nodes if getattr(n.target, "__name__", "").startswith("gather")]
    assert [n.args[0].target for n in gathers] == [torch.ops.aten.embedding.default], gathers
    plan = sharded.autotp_plan
    transport = autotp.runtime.transport
    one_shot, transport.ONE_SHOT_BYTES = transport.ONE_SHOT_BYTES, 0
    with CommDebugMode() as forward:
        out = sharded(ids)
    with CommDebugMode() as backward:
        out.square().mean().backward()
    transport.ONE_SHOT_BYTES = one_shot
    assert plan_ops(comm_counts(forward)) == plan.collective_counts("forward"), comm_counts(forward)
    assert plan_ops(comm_counts(backward)) == plan.collective_counts("backward"), comm_counts(backward)
    model(ids).square().mean().backward()
    torch.testing.assert_close(out, model(ids), **TOL)
    grads = autotp.full_state_dict(sharded, grads=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("world", [2, 3])
def test_a_value_read_whole_by_sharded_and_replicated_ops_is_gathered_once(world):
    run_ranks(world, _gathered_once, captures=_read_twice_models)
