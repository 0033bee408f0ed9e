"""Options that pin what a hand plan pins: a module computed whole on every rank (``fixed={module: "R"}``, as vLLM's
ReplicatedLinear or a DSA indexer kept whole), and the sizes the large-parameter forcing compares
(``parameter_sizes``, a small config standing for a full one)."""

from __future__ import annotations

import warnings

import pytest
import torch

import autotp
from autotp.options import PlanOptions
from autotp.passes.prepared_graph import prepared_graph
from autotp.planning.analysis import offered
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL


class BiasedAttention(torch.nn.Module):
    """Attention whose scores get a per-head bias from a small MLP of relative positions (Swin's, inkling's): the
    MLP's output is [heads, n, n], which a plan may compute split by heads or whole and slice."""

    def __init__(self, hidden: int = 32, heads: int = 4, width: int = 64):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.out = torch.nn.Linear(hidden, hidden)
        self.bias = torch.nn.Sequential(torch.nn.Linear(1, width), torch.nn.ReLU(), torch.nn.Linear(width, heads))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        pos = torch.arange(n, dtype=x.dtype, device=x.device)
        rel = (pos[:, None] - pos[None, :]).unsqueeze(-1) / n
        bias = self.bias(rel).permute(2, 0, 1)  # [heads, n, n]
        scores = q @ k.transpose(-1, -2) / (c // self.heads) ** 0.5 + bias
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return BiasedAttention()


def test_a_module_fixed_whole_computes_every_op_whole_and_keeps_heads_split():
    model, x = _model(), torch.randn(2, 6, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # computed whole as asked: no op "without a rule" to warn of
        plan = autotp.plan(model, (x,), world_size=2, fixed={"bias": "R"})
    inside = {k: v for k, v in plan.nodes.items() if (v.get("module") or "").startswith("bias")}
    assert inside and all(v["out"] == "R" for v in inside.values()), inside
    assert all(plan.params[n] == "R" for n in plan.params if n.startswith("bias."))
    assert plan.params["qkv.weight"] != "R" and plan.params["out.weight"] != "R"
    softmax = [v for v in plan.nodes.values() if "softmax" in v.get("op", "")]
    assert softmax and all(v["out"].startswith("S(1") for v in softmax), softmax


def test_a_module_can_only_be_fixed_whole():
    with pytest.raises(ValueError, match=r"no parameter of the model.*computed whole"):
        autotp.plan(_model(), (torch.randn(2, 6, 32),), world_size=2, fixed={"bias": "S(0)"})


def _whole_module_exact(rank: int, world: int) -> None:
    model = _model()
    sharded = autotp.parallelize(model, (torch.randn(2, 6, 32),), fixed={"bias": "R"})
    for shape in ((2, 6, 32), (1, 1, 32), (3, 5, 32)):
        x = torch.randn(*shape)
        torch.testing.assert_close(sharded(x), model(x), **TOL)
    x = torch.randn(2, 6, 32)
    sharded(x).square().sum().backward()
    model(x).square().sum().backward()
    grads = autotp.full_state_dict(sharded, grads=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL)


def test_a_module_fixed_whole_runs_exact_at_two_ranks():
    run_ranks(2, _whole_module_exact)


def test_parameter_sizes_decide_which_parameters_must_shard():
    model, x = _model(), torch.randn(2, 6, 32)
    gm = prepared_graph(model, (x,), {}, True)
    own = offered(gm, 2, PlanOptions(min_shard_fraction=0.02))
    assert not any(p == autotp.placement.R for p in own["bias.0.weight"])  # 64 of 3072: over 2%, only sharded
    full = offered(gm, 2, PlanOptions(min_shard_fraction=0.02, parameter_sizes={"bias.0.weight": 10}))
    assert autotp.placement.R in full["bias.0.weight"]
    assert full["qkv.weight"] == own["qkv.weight"]  # the names it leaves out: at their own sizes
    with pytest.raises(ValueError, match="parameter_sizes maps parameter names"):
        PlanOptions(parameter_sizes={"bias.0.weight": 1.5})
