"""One mixture-of-experts layer (Mixtral's block: router, top-2 of 8 experts), forward and backward, on 4 gloo ranks:
expert parallelism by all-to-all, by local compute (whole experts, zero rows for the other ranks' tokens) and
expert tensor parallelism, side by side in one run.

    python benchmarks/moe_dispatch.py [--hidden 256] [--ffn 512] [--experts 8] [--tokens 512] [--repeats 7]

The first three share one TP group of all ranks, every rank holding the same tokens.  A fourth row is expert
parallelism by all-to-all over data-parallel ranks (a mesh's "ep" dimension): every rank its own tokens, so it
moves 4x the tokens per step; compare tokens/s.  The runners alternate within each repeat; times are medians with
the range over repeats (the slowest rank's time per step).  Memory: the peak of the process heap (glibc
``mallinfo2``: bytes in use, small and mapped blocks) above its level before the step, sampled after every op of
one step, and the bytes saved for backward (distinct storages), the largest over ranks.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import statistics
import time

import torch
import torch.distributed as dist
from machine import describe
from torch.utils._python_dispatch import TorchDispatchMode

import autotp
from autotp.tools.spawn import run_local

STRATEGIES = ("all-to-all", "parallel", "tensor", "all-to-all over ep")
NAMES = {
    "all-to-all": "EP by all-to-all (TP group)",
    "parallel": "EP by local compute (zero rows)",
    "tensor": "expert TP",
    "all-to-all over ep": "EP by all-to-all over DP ranks",
}


class _Info(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _heap():
    """Bytes the process heap has in use now (None where glibc's mallinfo2 is missing)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Info
    except (OSError, AttributeError):
        return None
    return lambda: (lambda m: m.uordblks + m.hblkhd)(libc.mallinfo2())


class _Peak(TorchDispatchMode):
    def __init__(self, heap):
        super().__init__()
        self.heap, self.start = heap, heap()
        self.peak = self.start

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.heap())
        return out


def _layer(o):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(
        MixtralConfig(
            vocab_size=64,
            hidden_size=o.hidden,
            intermediate_size=o.ffn,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_local_experts=o.experts,
            num_experts_per_tok=2,
            use_cache=False,
        )
    )
    return model.model.layers[0].mlp.train()


def _step(module, x, weights):
    y = module(x)
    (y * weights).sum().backward()  # weighted: a stride-0 gradient has no CPU grouped-matmul backward


def _kept(module, x, weights) -> int:
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = module(x)
    (y * weights).sum().backward()
    return sum(storages.values())


def _run(rank: int, world: int, o) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(1)
    x, weights = torch.randn(1, o.tokens, o.hidden), torch.randn(1, o.tokens, o.hidden)
    own = torch.randn(world, 1, o.tokens, o.hidden)[rank]  # over "ep": every rank its own tokens
    runners = {}
    for name in STRATEGIES:
        if name == "all-to-all over ep":
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
            runners[name] = (autotp.parallelize(_layer(o), (own,), mesh=mesh), own)
        else:
            runners[name] = (autotp.parallelize(_layer(o), (x,), experts=name), x)
    heap = _heap()
    found = {name: {"ms": []} for name in runners}
    for name, (module, inputs) in runners.items():
        _step(module, inputs, weights)  # warm up
        found[name]["kept"] = _kept(module, inputs, weights)
        if heap is not None:
            with _Peak(heap) as peak:
                _step(module, inputs, weights)
            found[name]["peak"] = peak.peak - peak.start
        module.zero_grad(set_to_none=True)
    for _ in range(o.repeats):
        for name, (module, inputs) in runners.items():
            dist.barrier()
            start = time.perf_counter()
            _step(module, inputs, weights)
            seconds = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank sets the step
            found[name]["ms"].append(seconds.item() * 1e3)
            module.zero_grad(set_to_none=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--world", type=int, default=4)
    o = parser.parse_args()
    ranks = run_local(o.world, _run, o, timeout=600)
    print(f"{datetime.date.today()}  {describe('gloo')}")
    print(
        f"one Mixtral MoE layer, hidden {o.hidden}, ffn {o.ffn}, {o.experts} experts, top-2, {o.tokens} tokens per "
        f"rank, forward + backward, {o.world} ranks, {o.repeats} repeats"
    )
    print(
        f"{'strategy':<34} {'tokens/step':>11} {'ms/step median (min-max)':>26} {'tokens/s':>9} "
        f"{'peak heap MB':>12} {'kept MB':>8}"
    )
    for name in STRATEGIES:
        ms = ranks[0][name]["ms"]
        tokens = o.tokens * (o.world if name == "all-to-all over ep" else 1)
        peak = [r[name].get("peak") for r in ranks]
        peak_text = "n/a" if None in peak else f"{max(peak) / 1e6:.1f}"
        kept = max(r[name]["kept"] for r in ranks) / 1e6
        median = statistics.median(ms)
        print(
            f"{NAMES[name]:<34} {tokens:>11} {median:>10.1f} ({min(ms):.1f}-{max(ms):.1f}){'':>6} "
            f"{tokens / median * 1e3:>9.0f} {peak_text:>12} {kept:>8.2f}"
        )


if __name__ == "__main__":
    main()
