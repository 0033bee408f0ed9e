"""Planning time against depth: capture / solve / rewrite / total seconds for a LLaMA-3-70B-shaped
config (hidden 8192, 64 heads, 8 KV heads, FFN 28672, vocab 128256) on the meta device, world size 8.

    python benchmarks/plan_scaling.py [--layers 2 8 32 80 126] [--world-size 8]

The rewrite is timed without loading weights (each rank's shards are empty meta tensors).
"""
from __future__ import annotations

import argparse
import time

import torch


class _EmptyShards:
    """Stands in for a checkpoint: every tensor this rank would load, as an empty meta tensor."""

    shares = True
    directory = "(empty meta shards)"

    def __init__(self, model: torch.nn.Module):
        self.shapes = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}
        self.files = dict.fromkeys(self.shapes)

    def shape(self, name: str) -> tuple:
        return self.shapes[name]

    def read(self, name: str, placement, rank: int, world: int) -> torch.Tensor:
        shape = list(self.shapes[name])
        if hasattr(placement, "local_size"):
            shape[placement.dim] = placement.local_size(shape[placement.dim], rank, world)
        return torch.empty(shape, device="meta", dtype=torch.bfloat16)


def measure(layers: int, world: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from autotp.api import _graph, _solve
    from autotp.passes.rewrite import rewrite
    from autotp.passes.strategies import Strategy
    config = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                         num_hidden_layers=layers, vocab_size=128256, max_position_embeddings=8192, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.zeros(2, 2048, dtype=torch.long, device="meta")
    times = {}
    start = time.perf_counter()
    gm = _graph(model, (ids,), None)
    times["capture"] = time.perf_counter() - start
    start = time.perf_counter()
    plan = _solve(gm, world, "dgx-h100", training=False)
    times["solve"] = time.perf_counter() - start
    start = time.perf_counter()
    choice = {}
    for node in gm.graph.nodes:
        if node.name in plan.nodes:
            inputs, output = plan.strategy(node.name)
            choice[node] = Strategy(tuple(inputs), output)
    rewrite(gm, choice, 0, world, "unused", _EmptyShards(model), torch.device("meta"))
    times["rewrite"] = time.perf_counter() - start
    times["total"] = sum(times.values())
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32, 80, 126])
    parser.add_argument("--world-size", type=int, default=8)
    args = parser.parse_args()
    print(f"{'layers':>6} {'capture s':>10} {'solve s':>8} {'rewrite s':>10} {'total s':>8}")
    for layers in args.layers:
        t = measure(layers, args.world_size)
        print(f"{layers:>6} {t['capture']:>10.1f} {t['solve']:>8.1f} {t['rewrite']:>10.1f} {t['total']:>8.1f}",
              flush=True)


if __name__ == "__main__":
    main()
