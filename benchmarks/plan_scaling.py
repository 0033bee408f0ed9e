"""Planning time against depth for a LLaMA-3-70B-shaped config (hidden 8192, 64 heads, 8 KV heads,
FFN 28672, vocab 128256) on the meta device, world size 8; first, ``autotp mesh`` for a 405B-shaped
config on 512 GPUs against ``autotp plan`` on one TP group.

    python benchmarks/plan_scaling.py [--layers 2 8 32 80 126] [--world-size 8] [--plan-only]
                                      [--mesh-layers 126] [--mesh-hidden 16384]

Left: what ``autotp.plan`` costs from model to plan (the model is built on meta and captured with
four of its blocks, passes/fold.py).  Right: the program a rank runs (every block captured, plan
stamped, rewritten without loading weights: each rank's shards are empty meta tensors), and the
whole graph solved without folding, to check the folded plan is the same in every op.

Absolute seconds depend on the machine (printed first), so the run also times a yardstick: a plain
``torch.export`` (non-strict, dynamic batch and sequence) of the same config with two blocks, on
meta, the fastest of two; "plan / yardstick" and "full capture / yardstick" are the ratios to it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from machine import describe


def _model(layers: int) -> torch.nn.Module:
    """The LLaMA-3-70B shape with ``layers`` blocks, on meta in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        num_hidden_layers=layers,
        vocab_size=128256,
        max_position_embeddings=8192,
        use_cache=False,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def _ids() -> torch.Tensor:
    return torch.zeros(2, 2048, dtype=torch.long, device="meta")


def yardstick() -> float:
    """Seconds of a plain torch.export of two blocks (the fastest of two: the first also warms up)."""
    from torch.export import Dim

    model, seconds = _model(2), []
    for _ in range(2):
        start = time.perf_counter()
        torch.export.export(model, (_ids(),), dynamic_shapes={"input_ids": {0: Dim.AUTO, 1: Dim.AUTO}}, strict=False)
        seconds.append(time.perf_counter() - start)
    return min(seconds)


def measure(layers: int, world: int, whole: bool) -> dict:
    from autotp.options import PlanOptions
    from autotp.passes.capture import fingerprint
    from autotp.passes.prepared_graph import prepared_graph
    from autotp.passes.rewrite import rewrite
    from autotp.planning.plan_choice import plan_choice
    from autotp.planning.tensor_plan import solve_plan
    from autotp.runtime.expert_dispatch import Group

    times = {}
    start = time.perf_counter()
    model, ids = _model(layers), _ids()
    folded = prepared_graph(model, (ids,), None, fold=True)  # what autotp.plan captures
    times["capture"] = time.perf_counter() - start
    start = time.perf_counter()
    plan = solve_plan(folded, world, PlanOptions(topology="dgx-h100", training=False))
    times["solve"] = time.perf_counter() - start
    times["plan"] = times["capture"] + times["solve"]
    if not whole:
        return times
    start = time.perf_counter()
    gm = prepared_graph(model, (ids,), None)  # the program each rank runs has every block
    times["full capture"] = time.perf_counter() - start
    start = time.perf_counter()
    reference = solve_plan(gm, world, PlanOptions(topology="dgx-h100", training=False))
    times["whole solve"] = time.perf_counter() - start
    start = time.perf_counter()
    choice = plan_choice(gm, plan, fingerprint(gm), world)  # the folded plan stamped on every block
    times["rewrite"] = time.perf_counter() - start
    same = choice == plan_choice(gm, reference, fingerprint(gm), world) and plan.params == reference.params
    times["same"] = "yes" if same else "NO"
    start = time.perf_counter()
    # in place; meta weights stay meta, local
    rewrite(gm, choice, Group("unused", 0, world), device=torch.device("meta"))
    times["rewrite"] += time.perf_counter() - start
    return times


def _cpu_seconds() -> float:
    """This process's CPU time and its finished children's (the ILP solver runs as a child): on a shared
    machine it varies less than the wall clock."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def mesh_against_plan(layers: int, hidden: int) -> None:
    """``autotp mesh`` for a Llama-3-405B-shaped config (hidden 16384, 128 heads, 8 KV heads, FFN 53248,
    vocab 128256, 126 layers) on 512 GPUs (64 DGX H100), against ``autotp plan`` of the same model on one
    TP group of 8, both from the meta model to the answer, measured one after the other."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import autotp

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 13 // 4,
        num_attention_heads=hidden // 128,
        num_key_value_heads=min(8, hidden // 128),
        num_hidden_layers=layers,
        vocab_size=128256,
        max_position_embeddings=8192,
        use_cache=False,
    )
    ids = torch.zeros(2, 8192, dtype=torch.long, device="meta")
    with torch.device("meta"):  # warm-up: imports and torch.export's first call are paid by neither timing
        autotp.plan(
            LlamaForCausalLM(
                LlamaConfig(
                    hidden_size=256,
                    intermediate_size=512,
                    num_attention_heads=2,
                    num_key_value_heads=2,
                    num_hidden_layers=2,
                    vocab_size=256,
                )
            ),
            (ids[:, :16],),
            world_size=2,
        )
    times, cpu = {}, {}
    for what in ("plan", "mesh"):
        start, start_cpu = time.perf_counter(), _cpu_seconds()
        with torch.device("meta"):
            model = LlamaForCausalLM(config).to(torch.bfloat16)
        if what == "plan":
            # 405B does not fit one group of 8: priced without a memory limit, one solve as the mesh's are
            autotp.plan(model, (ids,), world_size=8, topology="dgx-h100", memory_limit=float("inf"))
        else:
            result = autotp.plan_mesh(model, (ids,), topology="dgx-h100", nodes=64, global_batch=2048)
        times[what], cpu[what] = time.perf_counter() - start, _cpu_seconds() - start_cpu
    c = result.choice
    if c.tp * c.pp * c.dp != 512 or not c.fits:
        sys.exit(f"the mesh choice is not a layout of 512 devices that fits: {c}")
    print(
        f"{layers} layers, hidden {hidden}: autotp plan (TP 8) {times['plan']:.1f} s, autotp mesh (512 GPUs, "
        f"64 DGX H100) {times['mesh']:.1f} s: {times['mesh'] / times['plan']:.2f}x (goal <= 3x; CPU seconds "
        f"{cpu['plan']:.1f} and {cpu['mesh']:.1f}: {cpu['mesh'] / cpu['plan']:.2f}x); choice TP {c.tp} "
        f"x PP {c.pp} x DP {c.dp}, {c.microbatches} micro-batches of {c.microbatch_size}, "
        f"{c.schedule or 'no pipeline'}{', recomputing' if c.recompute else ''}, est. step {c.step_seconds:.2f} s, "
        f"{c.memory_bytes / 1e9:.1f} GB/device, MFU {c.mfu:.1%}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32, 80, 126])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--plan-only", action="store_true", help="skip the whole-graph capture, rewrite and check")
    parser.add_argument("--mesh-layers", type=int, default=126, help="layers of the 405B-shaped mesh config")
    parser.add_argument("--mesh-hidden", type=int, default=16384, help="hidden size of the 405B-shaped mesh config")
    args = parser.parse_args()
    print(describe())
    mesh_against_plan(args.mesh_layers, args.mesh_hidden)
    base = yardstick()
    print(f"yardstick: torch.export of 2 blocks {base:.2f} s")
    print(
        f"{'layers':>6} | {'capture s':>9} {'solve s':>8} {'plan s':>7} {'plan / yardstick':>16} | "
        f"{'full capture s':>14} {'/ yardstick':>11} {'rewrite s':>9} {'whole-graph solve s':>19} {'same plan':>9}"
    )
    differs = False
    for layers in args.layers:
        t = measure(layers, args.world_size, not args.plan_only)
        rest = (
            f"{t['full capture']:>14.1f} {t['full capture'] / base:>10.1f}x {t['rewrite']:>9.1f} "
            f"{t['whole solve']:>19.1f} {t['same']:>9}"
            if "rewrite" in t
            else ""
        )
        print(
            f"{layers:>6} | {t['capture']:>9.2f} {t['solve']:>8.2f} {t['plan']:>7.2f} {t['plan'] / base:>15.2f}x | "
            f"{rest}",
            flush=True,
        )
        differs = differs or t.get("same") == "NO"
    if differs:
        sys.exit("the folded plan differs from the whole-graph plan")


if __name__ == "__main__":
    main()
