"""`autotp demo`: plan a small LLaMA for 2 ranks, run it on 2 gloo processes, compare with one process."""
from __future__ import annotations

import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console

WORLD = 2


def build_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128, use_cache=False)
    return LlamaForCausalLM(config).eval()


def _rank(rank: int, port: int, queue) -> None:
    import autotp
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    try:
        model = build_llama()
        sharded = autotp.parallelize(model)
        ids = torch.randint(0, 256, (3, 11), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            got, want = sharded(ids).logits, model(ids).logits
        error = (got - want).abs().max().item()
        match = torch.allclose(got, want, rtol=1e-4, atol=1e-5)
        local = sum(p.numel() * p.element_size() for p in sharded.parameters())
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        queue.put((rank, match, error, local, full))
    finally:
        dist.destroy_process_group()
    # gloo's threads can abort a process during interpreter teardown ("terminate called without an
    # active exception") after all work is done: hand over the result and leave without teardown
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    os._exit(0)


def main() -> int:
    import autotp
    from autotp.report import print_plan, tensor_shapes

    console = Console(width=140)
    console.print("[bold]autotp demo[/]: a 2-layer LLaMA (GQA: 8 heads, 4 KV heads), planned for 2 ranks\n")
    model = build_llama()
    plan = autotp.plan(model, world_size=WORLD)
    print_plan(plan, tensor_shapes(model), console)

    console.print(f"\nspawning {WORLD} gloo processes and running the sharded model ...")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_rank, args=(port, queue), nprocs=WORLD, join=True, start_method="spawn")
    results = sorted(queue.get() for _ in range(WORLD))
    ok = all(r[1] for r in results)
    for rank, match, error, local, full in results:
        console.print(f"rank {rank}: logits match single process: {'[green]yes' if match else '[red]NO'}[/] "
                      f"(max abs diff {error:.2e}); parameters {local / 1e6:.2f} MB of {full / 1e6:.2f} MB "
                      f"({local / full:.0%})")
    console.print("\n[green]sharded == single-process[/]" if ok else "\n[red]MISMATCH[/]")
    return 0 if ok else 1
