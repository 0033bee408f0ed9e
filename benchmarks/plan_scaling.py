"""Planning time against depth for a LLaMA-3-70B-shaped config (hidden 8192, 64 heads, 8 KV heads,
FFN 28672, vocab 128256) on the meta device, world size 8.

    python benchmarks/plan_scaling.py [--layers 2 8 32 80 126] [--world-size 8] [--plan-only]

Left: what ``autotp.plan`` costs from model to plan (the model is built on meta and captured with
four of its blocks, passes/fold.py).  Right: the program a rank runs (every block captured, plan
stamped, rewritten without loading weights: each rank's shards are empty meta tensors), and the
whole graph solved without folding, to check the folded plan is the same in every op.
"""
from __future__ import annotations

import argparse
import sys
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


def measure(layers: int, world: int, whole: bool) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from autotp.api import _choice, _graph, _solve
    from autotp.passes.capture import fingerprint
    from autotp.passes.rewrite import rewrite
    config = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                         num_hidden_layers=layers, vocab_size=128256, max_position_embeddings=8192, use_cache=False)
    times = {}
    start = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.zeros(2, 2048, dtype=torch.long, device="meta")
    folded = _graph(model, (ids,), None, fold=True)  # what autotp.plan captures
    times["capture"] = time.perf_counter() - start
    start = time.perf_counter()
    plan = _solve(folded, world, "dgx-h100", training=False)
    times["solve"] = time.perf_counter() - start
    times["plan"] = times["capture"] + times["solve"]
    if not whole:
        return times
    start = time.perf_counter()
    gm = _graph(model, (ids,), None)  # the program each rank runs has every block
    times["full capture"] = time.perf_counter() - start
    start = time.perf_counter()
    reference = _solve(gm, world, "dgx-h100", training=False)
    times["whole solve"] = time.perf_counter() - start
    start = time.perf_counter()
    choice = _choice(gm, plan, fingerprint(gm), world)  # the folded plan stamped on every block
    times["rewrite"] = time.perf_counter() - start
    same = choice == _choice(gm, reference, fingerprint(gm), world) and plan.params == reference.params
    times["same"] = "yes" if same else "NO"
    start = time.perf_counter()
    rewrite(gm, choice, 0, world, "unused", _EmptyShards(model), torch.device("meta"))  # rewrites gm in place
    times["rewrite"] += time.perf_counter() - start
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32, 80, 126])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--plan-only", action="store_true", help="skip the whole-graph capture, rewrite and check")
    args = parser.parse_args()
    print(f"{'layers':>6} | {'capture s':>9} {'solve s':>8} {'plan s':>7} | {'full capture s':>14} {'rewrite s':>9} "
          f"{'whole-graph solve s':>19} {'same plan':>9}")
    differs = False
    for layers in args.layers:
        t = measure(layers, args.world_size, not args.plan_only)
        rest = (f"{t['full capture']:>14.1f} {t['rewrite']:>9.1f} {t['whole solve']:>19.1f} {t['same']:>9}"
                if "rewrite" in t else "")
        print(f"{layers:>6} | {t['capture']:>9.2f} {t['solve']:>8.2f} {t['plan']:>7.2f} | {rest}", flush=True)
        differs = differs or t.get("same") == "NO"
    if differs:
        sys.exit("the folded plan differs from the whole-graph plan")


if __name__ == "__main__":
    main()
