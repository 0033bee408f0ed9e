"""A view's input keeps the layout the model gave it once the graph is prepared.  Gated attention (Laguna's
``(out.view(b, s, h, d) * gate.unsqueeze(-1)).view(b, s, -1)`` after ``out.transpose(1, 2).contiguous().reshape(b,
s, -1)``): the contiguous is dropped (its reader, a reshape, copies if it must) and the reshape-then-view is undone
into one view (canonicalize/merged_views.py), so the gate's product inherited the transposed layout and the last view
failed at run time ("view size is not compatible with input tensor's size and stride").  Attention over one token a row
(MobileViT's last stage at small images: [B*P, 1, E] viewed as [B*P, 1, H, d]): a size-1 dim after a run of equal
sizes joined the next run, so the heads had no image in the view.  Both found by the coverage sweep."""

from __future__ import annotations

import torch
from torch import nn

import autotp
from autotp.ops.views import map_view_dim
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
        out = torch.softmax(q @ k.transpose(2, 3) / HEAD_DIM**0.5, dim=-1) @ v
        out = out.transpose(1, 2).contiguous().reshape(b, s, -1).contiguous()
        gate = nn.functional.softplus(self.gate(h))
        return h + self.o((out.view(b, s, -1, HEAD_DIM) * gate.unsqueeze(-1)).view(b, s, -1))


class OneTokenBlock(nn.Module):
    """A pre-norm block whose rows are one token each (dim 1 of size 1, fixed by the capture)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.ModuleList(nn.Linear(DIM, HEADS * HEAD_DIM) for _ in range(3))
        self.o, self.up, self.down = nn.Linear(DIM, DIM), nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, h):
        rows, one, _ = h.shape
        q, k, v = (proj(h).view(rows, one, HEADS, -1).transpose(1, 2) for proj in self.qkv)
        out = torch.softmax(q @ k.transpose(-1, -2) / HEAD_DIM**0.5, dim=-1) @ v
        h = h + self.o(out.permute(0, 2, 1, 3).reshape(rows, one, DIM))
        return h + self.down(torch.relu(self.up(h)))


def test_a_size_one_dim_ends_its_run():
    assert map_view_dim([5, 1, 32], [5, 1, 4, 8], 2, 2) == (2, False)  # the heads
    assert map_view_dim([5, 1, 4, 8], [5, 1, 32], 2, 2) == (2, False)
    assert map_view_dim([6, 1], [6], 0, 2) == (0, True)


def _run(rank: int, world: int, make=GatedAttention, shape=(2, 6)) -> None:
    model, h = make(), torch.randn(*shape, DIM)
    sharded = autotp.parallelize(model, (h,))
    assert sharded.autotp_plan.params["o.weight"] == "S(1)", sharded.autotp_plan.params  # split by heads
    inputs = (h, torch.randn(1, 1, DIM), torch.randn(3, 5, DIM)) if shape[1] > 1 else (h, torch.randn(1, 1, DIM))
    for x in inputs:
        torch.testing.assert_close(sharded(x), model(x), **TOL)
    sharded(h).square().mean().backward()
    model(h).square().mean().backward()
    grads = autotp.full_state_dict(sharded, grads=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL)


def test_gated_heads_after_a_dropped_contiguous_run_exact():
    run_ranks(2, _run)


def _one_token(rank: int, world: int) -> None:
    plan = autotp.plan(OneTokenBlock(), (torch.randn(4, 1, DIM),), world_size=world)
    assert {plan.params[f"qkv.{i}.weight"] for i in range(3)} == {"S(0)"}, plan.params
    forward = [c["op"] for c in plan.collectives if c["phase"] == "forward"]
    assert forward == ["all_reduce", "all_reduce"], plan.collectives  # Megatron's: one a sublayer
    _run(rank, world, OneTokenBlock, (4, 1))


def test_attention_over_one_token_split_by_heads_exact():
    run_ranks(2, _one_token)
