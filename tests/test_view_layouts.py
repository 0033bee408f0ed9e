"""A view's input keeps the layout the model gave it once the graph is prepared.  Gated attention (Laguna's
``(out.view(b, s, h, d) * gate.unsqueeze(-1)).view(b, s, -1)`` after ``out.transpose(1, 2).contiguous().reshape(b,
s, -1)``): the contiguous is dropped (its reader, a reshape, copies if it must) and the reshape-then-view is undone
into one view (passes/unmerge.py), so the gate's product inherited the transposed layout and the last view failed
at run time ("view size is not compatible with input tensor's size and stride").  Found by the coverage sweep."""
from __future__ import annotations

import torch
from torch import nn

import autotp
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL

HEADS, HEAD_DIM, DIM = 4, 8, 32


class GatedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.ModuleList(nn.Linear(DIM, HEADS * HEAD_DIM, bias=False) for _ in range(3))
        self.gate = nn.Linear(DIM, HEADS, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, h):
        b, s, _ = h.shape
        q, k, v = (proj(h).view(b, s, HEADS, HEAD_DIM).transpose(1, 2) for proj in self.qkv)
        out = torch.softmax(q @ k.transpose(2, 3) / HEAD_DIM ** 0.5, dim=-1) @ v
        out = out.transpose(1, 2).contiguous().reshape(b, s, -1).contiguous()
        gate = nn.functional.softplus(self.gate(h))
        return h + self.o((out.view(b, s, -1, HEAD_DIM) * gate.unsqueeze(-1)).view(b, s, -1))


def _run(rank: int, world: int) -> None:
    model, h = GatedAttention(), torch.randn(2, 6, DIM)
    sharded = autotp.parallelize(model, (h,))
    assert sharded.autotp_plan.params["o.weight"] == "S(1)", sharded.autotp_plan.params  # split by heads
    for x in (h, torch.randn(1, 1, DIM), torch.randn(3, 5, DIM)):
        torch.testing.assert_close(sharded(x), model(x), **TOL)
    sharded(h).square().mean().backward()
    model(h).square().mean().backward()
    grads = autotp.full_state_dict(sharded, grads=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL)


def test_gated_heads_after_a_dropped_contiguous_run_exact():
    run_ranks(2, _run)
