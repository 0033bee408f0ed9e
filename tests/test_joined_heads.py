"""Values joined from pieces along a dim, then read by one weight: two kinds of heads concatenated before the output
projection (ConvBERT's self-attention heads beside its span-convolution heads), a feature map joined with the input
it is fused with (MobileViT).  The join's blocks walk forwards to the weight (passes/hints.join_hints), which then
follows them (S(1|a,b)): each piece stays split as it was made, one all-reduce after the projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import autotp
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import same_as_model

DIM, HEAD_DIM = 32, 8


class JoinedHeads(nn.Module):
    """Two attention heads and two heads gated by their own softmax, joined along the heads dim; an MLP whose
    input joins its hidden features with the block's input (each half read by the down projection)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v, self.g, self.u = (nn.Linear(DIM, 2 * HEAD_DIM) for _ in range(5))
        self.o = nn.Linear(4 * HEAD_DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(3 * DIM, DIM)

    def forward(self, h):
        b, s, _ = h.shape
        q, k, v = (proj(h).view(b, s, 2, HEAD_DIM).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        gate = torch.softmax(self.g(h).view(b, s, 2, HEAD_DIM), dim=-1)
        gated = self.u(h).view(b, s, 2, HEAD_DIM) * gate
        h = h + self.o(torch.cat([attended, gated], dim=2).reshape(b, s, -1))
        return h + self.down(torch.cat([F.gelu(self.up(h)), h], dim=-1))


def _run(rank: int, world: int) -> None:
    model = JoinedHeads().train()
    sharded = autotp.parallelize(model, (torch.randn(2, 6, DIM),))
    plan = sharded.autotp_plan
    assert plan.params["o.weight"] == "S(1|16,16)", plan.params  # each kind of heads split in its own block
    assert {plan.params[f"{n}.weight"] for n in "qkvgu"} == {"S(0)"}, plan.params
    forward = [c["op"] for c in plan.collectives if c["phase"] == "forward"]
    assert forward.count("all_reduce") == 2 and set(forward) == {"all_reduce"}, plan.collectives
    same_as_model(model, sharded, lambda batch, seq: (torch.randn(batch, seq, DIM),))


def test_two_kinds_of_heads_joined_split_by_heads_exact():
    run_ranks(2, _run)
