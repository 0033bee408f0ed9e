"""Imported once by the local fork server (tools/spawn.py), so that every rank forked from it starts warm.

A rank's first capture also pays for what torch.export and transformers load lazily (about 450 modules: export's
passes, the partitioner and networkx, transformers' masks and generation; 0.3-0.4 s on the 2-core VM) and for
caches the first trace fills, in every process of every short run (the test suite spawns hundreds).  Measured
there: a 2-layer LLaMA's first capture in a rank 1.9 s cold vs 1.7 s warm (means of 8), three test files 3% faster.
A small capture on the meta device here does it once; nothing runs on real tensors, so no thread pool is started
before the fork.  Any failure only loses the head start."""

from __future__ import annotations

import importlib
import importlib.util

import torch

_MODULES = [
    "torch.export._trace",
    "torch._functorch.aot_autograd",
    "torch._functorch.partitioners",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "pulp",
    "transformers.generation.utils",
    "transformers.masking_utils",
    "transformers.modeling_layers",
]


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 4).transpose(1, 3).unbind(2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).softmax(-1).sum()


def warm() -> None:
    for name in _MODULES:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            importlib.import_module(name)
    import autotp

    for name in autotp.__all__:  # the public names load on first use (autotp/__init__.py): load them all here
        getattr(autotp, name)
    from autotp.passes.capture import capture

    with torch.device("meta"):
        capture(_Attention(), (torch.randn(2, 3, 8),))


try:
    warm()
except Exception:  # a warm-up that fails costs the ranks their head start, nothing else
    pass
