"""A new tensor filled slice by slice (MLA's keys: ``k = x.new_empty(...); k[..., :n].copy_(a); k[..., n:].copy_(b)``)
is prepared as the concatenation of its fills (canonicalize/slice_fills.py), so attention built on it splits by heads;
any other write into a slice stays as it is.  No ranks: the prepared graph and the plan."""

from __future__ import annotations

import torch
from torch import nn

import autotp
from autotp.passes.prepared_graph import prepared_graph
from tests.helpers.exact import TOL

HEADS, NOPE, ROPE, DIM = 4, 8, 4, 32


class FilledKeys(nn.Module):
    """Attention whose keys are a fresh tensor filled from a per-head part and a part shared by every head."""

    def __init__(self, fill: str = "whole"):
        super().__init__()
        torch.manual_seed(0)
        self.fill = fill
        self.q = nn.Linear(DIM, HEADS * (NOPE + ROPE), bias=False)
        self.k = nn.Linear(DIM, HEADS * NOPE, bias=False)
        self.rope = nn.Linear(DIM, ROPE, bias=False)
        self.v = nn.Linear(DIM, HEADS * NOPE, bias=False)
        self.o = nn.Linear(HEADS * NOPE, DIM, bias=False)

    def forward(self, h):
        b, s, _ = h.shape
        q = self.q(h).view(b, s, HEADS, -1).transpose(1, 2)
        k_nope = self.k(h).view(b, s, HEADS, NOPE).transpose(1, 2)
        k_rot = self.rope(h).view(b, 1, s, ROPE).expand(-1, HEADS, -1, -1)
        keys = k_nope.new_empty(b, HEADS, s, NOPE + ROPE)
        keys[..., :NOPE].copy_(k_nope)
        if self.fill == "whole":
            keys[..., NOPE:].copy_(k_rot)
        else:  # the rope part left as new_empty made it, then zeroed: not a fill of the whole tensor
            keys[..., NOPE:].zero_()
        v = self.v(h).view(b, s, HEADS, NOPE).transpose(1, 2)
        out = nn.functional.scaled_dot_product_attention(q, keys, v, is_causal=True)
        return h + self.o(out.transpose(1, 2).reshape(b, s, -1))


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_a_tensor_filled_slice_by_slice_is_a_cat_of_its_fills():
    model, h = FilledKeys(), torch.randn(2, 6, DIM)
    gm = prepared_graph(model, (h,))
    targets = _targets(gm)
    assert torch.ops.aten.copy_.default not in targets and torch.ops.aten.new_empty.default not in targets, targets
    assert torch.ops.aten.cat.default in targets
    other = torch.randn(3, 5, DIM)
    torch.testing.assert_close(gm(other), model(other), **TOL)
    plan = autotp.plan(model, (h,), world_size=2)
    assert plan.replicated_ops == [] and plan.params["k.weight"] == "S(0)" and plan.params["o.weight"] == "S(1)", (
        plan.params
    )
    core = next(e for e in plan.nodes.values() if "scaled_dot_product" in str(e.get("op")))
    assert core["out"] == "S(1)", core  # attention split by heads: each rank its heads of the filled keys
    assert plan.collective_counts("forward")["all_reduce"] == 1, plan.collectives


def test_a_partial_fill_is_left_as_it_is():
    model, h = FilledKeys(fill="partial"), torch.randn(2, 6, DIM)
    targets = _targets(prepared_graph(model, (h,)))
    assert torch.ops.aten.copy_.default in targets and torch.ops.aten.new_empty.default in targets, targets
