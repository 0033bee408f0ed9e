"""A hand-written mixture-of-experts block: a top-k router and experts stored as 3-D parameters, computed
with one ``bmm`` per projection over the weights each routed token picks (``w[expert_ids]``).

``interleaved=True`` keeps gate and up columns interleaved in one tensor (gate in even, up in odd columns,
as gpt-oss does) and ``bias=True`` gives every expert projection a bias.  ``ModuleMoE`` keeps its experts as a list
of modules instead."""

import torch
import torch.nn.functional as F
from torch import nn


class MoE(nn.Module):
    def __init__(
        self,
        hidden: int = 32,
        ffn: int = 48,
        experts: int = 6,
        top_k: int = 2,
        interleaved: bool = False,
        bias: bool = False,
    ):
        super().__init__()
        self.top_k, self.interleaved = top_k, interleaved
        self.norm = nn.LayerNorm(hidden)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.gate_up = nn.Parameter(torch.randn(experts, 2 * ffn, hidden) * hidden**-0.5)
        self.down = nn.Parameter(torch.randn(experts, hidden, ffn) * ffn**-0.5)
        self.gate_up_bias = nn.Parameter(0.1 * torch.randn(experts, 2 * ffn)) if bias else None
        self.down_bias = nn.Parameter(0.1 * torch.randn(experts, hidden)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.norm(x).reshape(-1, x.shape[-1])  # [T, H]
        weights, ids = self.router(tokens).softmax(-1).topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).reshape(-1, 1)  # [T*k, 1]
        ids = ids.reshape(-1)  # [T*k]: each token's experts
        routed = tokens.repeat_interleave(self.top_k, dim=0).unsqueeze(-1)  # [T*k, H, 1]
        h = torch.bmm(self.gate_up[ids], routed).squeeze(-1)  # [T*k, 2F]
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[ids]
        gate, up = (h[..., ::2], h[..., 1::2]) if self.interleaved else h.chunk(2, dim=-1)
        out = torch.bmm(self.down[ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)  # [T*k, H]
        if self.down_bias is not None:
            out = out + self.down_bias[ids]
        combined = (out * weights).view(-1, self.top_k, x.shape[-1]).sum(1)  # each token's experts, weighted
        return x + combined.view(x.shape)


class ModuleMoE(nn.Module):
    """Experts as a list of modules (one gated MLP each) and routing as weights: every expert runs on every token
    and its output is scaled by the token's routing weight for it, zero where the router did not pick it."""

    def __init__(self, hidden: int = 32, ffn: int = 48, experts: int = 6, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.norm = nn.LayerNorm(hidden)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.ModuleDict(
                {
                    "gate": nn.Linear(hidden, ffn, bias=False),
                    "up": nn.Linear(hidden, ffn, bias=False),
                    "down": nn.Linear(ffn, hidden, bias=False),
                }
            )
            for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.norm(x)
        weights, ids = self.router(tokens).softmax(-1).topk(self.top_k, dim=-1)
        routing = torch.zeros(*tokens.shape[:-1], len(self.experts), dtype=x.dtype).scatter(-1, ids, weights)
        out = sum(
            routing[..., e : e + 1] * expert["down"](F.silu(expert["gate"](tokens)) * expert["up"](tokens))
            for e, expert in enumerate(self.experts)
        )
        return x + out


def build(
    blocks: int = 2,
    hidden: int = 32,
    ffn: int = 48,
    experts: int = 6,
    top_k: int = 2,
    interleaved: bool = False,
    bias: bool = False,
    modules: bool = False,
):
    """The model and example inputs, as ``autotp plan examples.moe:build`` expects (``modules=True``: experts as a
    list of modules, ``ModuleMoE``)."""
    layer = (
        (lambda: ModuleMoE(hidden, ffn, experts, top_k))
        if modules
        else (lambda: MoE(hidden, ffn, experts, top_k, interleaved, bias))
    )
    model = nn.Sequential(*(layer() for _ in range(blocks)))
    return model, (torch.randn(2, 8, hidden),)
