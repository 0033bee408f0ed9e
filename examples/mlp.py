"""Megatron's MLP block: Linear -> GELU -> Linear (column split, then row split: one all-reduce)."""

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, hidden: int = 32, ffn: int = 128):
        super().__init__()
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


def build(hidden: int = 32, ffn: int = 128):
    """The model and example inputs, as ``autotp plan examples.mlp:build`` expects."""
    return MLP(hidden, ffn), (torch.randn(2, 8, hidden),)
