"""Attention computed on heads merged with the batch ([B*H, T, S], the BART-era eager layout of XGLM, TrOCR and MVP):
``q.bmm(k^T)`` or ``scores.view(b * h, t, s)``, a softmax and a dropout on the merged rows, then ``probs.bmm(v)``
viewed back.  canonicalize/merged_rows.py moves the merge past the row-wise ops so both products are 4-D
matmuls over heads a rule can split; before, the softmax's rows mixed heads and batch and attention ran whole."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp
from autotp.passes.prepared_graph import prepared_graph
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL

HEADS, HEAD_DIM, DIM = 4, 8, 32


class MergedHeads(nn.Module):
    """``scores``: "4d" computes q @ k^T on [B, H, ...] and views it merged (XGLM, TrOCR); "bmm" merges q and k
    first (MVP)."""

    def __init__(self, scores: str):
        super().__init__()
        torch.manual_seed(0)
        self.scores = scores
        self.q, self.k, self.v = (nn.Linear(DIM, HEADS * HEAD_DIM) for _ in range(3))
        self.o = nn.Linear(HEADS * HEAD_DIM, DIM)
        self.dropout = nn.Dropout(0.0)

    def forward(self, h):
        b, t, _ = h.shape
        q, k, v = (proj(h).view(b, t, HEADS, HEAD_DIM).transpose(1, 2) for proj in (self.q, self.k, self.v))
        if self.scores == "4d":
            scores = (q @ k.transpose(2, 3)).view(b * HEADS, t, t)
        else:
            scores = q.reshape(b * HEADS, t, HEAD_DIM).bmm(k.reshape(b * HEADS, t, HEAD_DIM).transpose(1, 2))
        probs = self.dropout(torch.softmax(scores / HEAD_DIM**0.5, dim=-1))
        out = probs.bmm(v.reshape(b * HEADS, t, HEAD_DIM)).view(b, HEADS, t, HEAD_DIM)
        return h + self.o(out.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("scores", ["4d", "bmm"])
def test_products_over_merged_heads_become_4d_and_split_by_heads(scores):
    model, h = MergedHeads(scores).eval(), torch.randn(2, 6, DIM)
    gm = prepared_graph(model, (h,))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.bmm.default not in targets, targets
    for x in (torch.randn(3, 5, DIM), torch.randn(1, 1, DIM)):
        torch.testing.assert_close(gm(x), model(x), **TOL)
    plan = autotp.plan(model, (h,), world_size=2)
    cores = [e for e in plan.nodes.values() if "softmax" in e["op"]]
    assert [e["out"] for e in cores] == ["S(1)"], cores  # on [B, H, T, S]: split by heads


def _run(rank: int, world: int) -> None:
    model, h = MergedHeads("bmm"), torch.randn(2, 6, DIM)
    sharded = autotp.parallelize(model, (h,))
    torch.testing.assert_close(sharded(h), model(h), **TOL)
    sharded(h).square().mean().backward()
    model(h).square().mean().backward()
    grads = autotp.full_state_dict(sharded, grads=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=name)


def test_merged_heads_train_exact_at_two_ranks():
    run_ranks(2, _run)
