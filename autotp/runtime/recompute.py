"""A piece of the program whose backward computes it again instead of keeping what its ops save
(torch.utils.checkpoint, non-reentrant: its inputs are kept, its RNG state restored for dropout)."""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


class Recomputed(torch.nn.Module):
    def __init__(self, region: torch.nn.Module):
        super().__init__()
        self.region = region

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return self.region(*args)
        # its forward, not the module: module hooks (CommDebugMode's tracker) must not see it run in backward
        return checkpoint(self.region.forward, *args, use_reentrant=False)
