"""Training step time on TP 2 x DP 2 (4 gloo ranks): autotp against a torchtitan-style hand-written
DTensor plan of the same model, same mesh, same batch, in one run.

    python benchmarks/train.py [--layers 4] [--hidden 256] [--seq 128] [--batch 8] [--repeats 10]

The hand-written plan is Megatron's, as torchtitan writes it for LLaMA (without sequence
parallelism): ``parallelize_module`` with q/k/v and gate/up ``ColwiseParallel``, o/down
``RowwiseParallel``, the embedding ``RowwiseParallel`` and the head ``ColwiseParallel`` gathering the
logits; then FSDP2 ``fully_shard`` on every block and the root over the "dp" dimension.  autotp:
``autotp.parallelize(model, args, mesh=mesh)`` (its plan on "tp", one ``fully_shard`` over "dp").
Each sample is one AdamW step (forward, loss, backward, optimizer); the two runners alternate, and
the medians and their ratio are printed.  Both start from the same weights; their losses are checked
equal before timing.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from examples.train import build, global_batch, loss_fn, parse


def hand_written(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """torchtitan's LLaMA plan on the "tp" dimension, FSDP2 per block and at the root on "dp"."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    parallelize_module(model, mesh["tp"], {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    })
    for block in model.model.layers:
        parallelize_module(block, mesh["tp"], {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
        })
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def _step(model, optimizer, x, y) -> tuple[float, float]:
    """(seconds, loss) of one training step, started together on every rank."""
    dist.barrier()
    start = time.perf_counter()
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - start, loss.item()


def run(rank: int, world: int, o: argparse.Namespace, repeats: int) -> dict | None:
    from torch.distributed.device_mesh import init_device_mesh

    import autotp
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x, y = (t.chunk(2)[mesh["dp"].get_local_rank()] for t in global_batch(o, 0))
    runners = {"autotp": autotp.parallelize(build(o), (x,), mesh=mesh), "hand-written": hand_written(build(o), mesh)}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=o.lr) for name, m in runners.items()}
    first = {name: _step(m, optimizers[name], x, y)[1] for name, m in runners.items()}
    if abs(first["autotp"] - first["hand-written"]) > 1e-4 * abs(first["hand-written"]) + 1e-5:
        raise AssertionError(f"the two runners disagree on the first loss: {first}")
    times: dict = {name: [] for name in runners}
    for _ in range(repeats):
        for name, m in runners.items():
            times[name].append(_step(m, optimizers[name], x, y)[0])
    return {name: statistics.median(t) for name, t in times.items()} if rank == 0 else None


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch (4 sequences per DP replica)")
    p.add_argument("--repeats", type=int, default=10)
    a = p.parse_args(argv)
    o = parse(["--layers", str(a.layers), "--hidden", str(a.hidden), "--seq", str(a.seq), "--batch", str(a.batch),
               "--heads", "8", "--kv-heads", "4", "--vocab", "1024"])
    from autotp.tools.spawn import run_local
    medians = run_local(4, run, o, a.repeats)[0]
    ratio = medians["autotp"] / medians["hand-written"]
    print(f"TP 2 x DP 2, 4 gloo ranks, LLaMA {a.layers} layers hidden {a.hidden}, global batch {a.batch} x {a.seq}: "
          f"step autotp {medians['autotp'] * 1e3:.1f} ms, hand-written DTensor + FSDP2 "
          f"{medians['hand-written'] * 1e3:.1f} ms, ratio {ratio:.2f}x (median of {a.repeats})")
    return medians


if __name__ == "__main__":
    main()
