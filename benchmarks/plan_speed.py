"""Time to a plan at the sizes users plan (issue 35): LLaMA-3 8B over 64 GPUs (``autotp mesh``: 8 nodes of 8,
tp x pp x dp searched) and LLaMA-3 70B at TP 8 for inference (``autotp plan``;
training it needs more than 8 devices' memory), on the meta device, this machine, one run.

    python benchmarks/plan_speed.py [--layers-8b 32] [--layers-70b 80] [--hidden-scale 1]

The published figure beside it was measured elsewhere, on other hardware and another search:
meta-pytorch/autoparallel reports 46.8 s for LLaMA-3 8B on a 64-GPU 2-D mesh (its PR #521).  Timing includes
building the model on meta, the capture (torch.export) and every solve; a yardstick (a plain torch.export of a
2-block model) says how fast this machine is.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch
from machine import describe

AUTOPARALLEL_8B_64_GPUS_S = 46.8  # meta-pytorch/autoparallel PR #521, its hardware


def _llama(hidden: int, ffn: int, heads: int, kv: int, layers: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=layers,
        vocab_size=vocab,
        max_position_embeddings=8192,
        dtype="bfloat16",
        use_cache=False,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(torch.bfloat16)


def _ids(batch: int = 2, seq: int = 16) -> tuple:
    return (torch.zeros(batch, seq, dtype=torch.long, device="meta"),)


def main(argv=None) -> None:
    import autotp

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers-8b", type=int, default=32)
    p.add_argument("--layers-70b", type=int, default=80)
    p.add_argument("--hidden-scale", type=float, default=1.0, help="shrink every width (a quick run)")
    o = p.parse_args(argv)
    warnings.simplefilter("ignore")
    w = lambda n: max(64, int(n * o.hidden_scale) // 64 * 64)  # noqa: E731
    print(describe())
    start = time.perf_counter()
    torch.export.export(_llama(w(4096), w(14336), 32, 8, 2, w(128256)), _ids(), strict=False)
    print(f"yardstick (torch.export of a 2-block 8B-shaped model): {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    mesh = autotp.plan_mesh(
        _llama(w(4096), w(14336), 32, 8, o.layers_8b, w(128256)),
        _ids(1, 8192),
        topology="dgx-h100",
        nodes=8,
        global_batch=512,
    )  # one micro-batch of one sequence
    mesh_s = time.perf_counter() - start
    best = mesh.choice
    print(
        f"LLaMA-3 8B ({o.layers_8b} layers) over 64 GPUs, autotp mesh: {mesh_s:.1f} s "
        f"(best tp {best.tp} x pp {best.pp} x dp {best.dp}, {len(mesh.candidates)} layouts priced); "
        f"autoparallel's published 8B on 64 GPUs: {AUTOPARALLEL_8B_64_GPUS_S} s (its hardware, PR #521)"
    )
    start = time.perf_counter()
    plan = autotp.plan(
        _llama(w(8192), w(28672), 64, 8, o.layers_70b, w(128256)),
        _ids(),
        world_size=8,
        topology="dgx-h100",
        training=False,
        price_at={"input_ids": (1, 8192)},
    )  # serving it
    print(
        f"LLaMA-3 70B ({o.layers_70b} layers) at TP 8, inference, autotp plan: {time.perf_counter() - start:.1f} s "
        f"(estimated step {plan.cost['seconds'] * 1e3:.1f} ms)"
    )
    print("time to a plan: measured")


if __name__ == "__main__":
    sys.exit(main())
