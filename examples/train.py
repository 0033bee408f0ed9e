"""Train a small LLaMA on a mesh of tensor (inside a node) x data x pipeline parallelism.

    torchrun --nproc-per-node 4 examples/train.py --tp 2 --dp 2            # one node, 4 GPUs (or CPU gloo)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/train.py --tp 8 --dp 2                                     # 2 nodes x 8 GPUs
    python examples/train.py --tp 2 --dp 2 --check                         # 4 local gloo ranks, compared
                                                                            # with one process
Every rank builds the same model (fixed seed) and reads the same global batch for each step; each DP
replica takes its slice.  ``autotp.parallelize(model, args, mesh=mesh)`` plans TP on the "tp"
dimension and shards with FSDP2 over "dp"; with ``--pp N`` it splits the model into pipeline stages
(``loss_fn`` and the ``step`` API).  Rank 0 prints loss, tokens/s and peak memory per step.
"""
from __future__ import annotations

import argparse
import os
import resource
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import autotp


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (consecutive ranks, one node)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--data-parallel", choices=["fsdp", "ddp"], default="fsdp")
    p.add_argument("--schedule", default="1f1b", help="pipeline schedule (with --pp)")
    p.add_argument("--microbatches", type=int, default=None, help="pipeline micro-batches (with --pp)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step, all replicas)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--check", action="store_true", help="also train in one process and compare the losses")
    return p.parse_args(argv)


def build(o: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=o.vocab, hidden_size=o.hidden, intermediate_size=2 * o.hidden,
                         num_hidden_layers=o.layers, num_attention_heads=o.heads, num_key_value_heads=o.kv_heads,
                         max_position_embeddings=max(64, o.seq), use_cache=False)
    return LlamaForCausalLM(config)


def global_batch(o: argparse.Namespace, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, next-token targets) of step ``step``, the same on every rank."""
    tokens = torch.randint(0, o.vocab, (o.batch, o.seq + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(output, target: torch.Tensor) -> torch.Tensor:
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def make_mesh(o: argparse.Namespace, device: str):
    """Outer to inner: pipeline stages, data replicas, TP group (consecutive ranks)."""
    sizes = {"pp": o.pp, "dp": o.dp, "tp": o.tp}
    dims = [d for d in ("pp", "dp") if sizes[d] > 1] + ["tp"]
    if o.pp * o.dp * o.tp != dist.get_world_size():
        raise SystemExit(f"--tp {o.tp} x --dp {o.dp} x --pp {o.pp} = {o.pp * o.dp * o.tp} ranks, but "
                         f"{dist.get_world_size()} were started")
    return init_device_mesh(device, tuple(sizes[d] for d in dims), mesh_dim_names=tuple(dims))


class Trainer:
    """This rank's parallel model and optimizer on the mesh ``o`` asks for."""

    def __init__(self, o: argparse.Namespace):
        if o.batch % o.dp:
            raise SystemExit(f"--batch {o.batch} must divide by --dp {o.dp}")
        self.o = o
        self.device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        self.mesh = make_mesh(o, self.device)
        self.replica = self.mesh["dp"].get_local_rank() if "dp" in self.mesh.mesh_dim_names else 0
        stage_options = {"loss_fn": loss_fn, "schedule": o.schedule, "microbatches": o.microbatches} if o.pp > 1 else {}
        self.model = autotp.parallelize(build(o).to(self.device), (self.share(global_batch(o, 0)[0]),), mesh=self.mesh,
                                        data_parallel=o.data_parallel, **stage_options)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr)

    def share(self, tensor: torch.Tensor) -> torch.Tensor:
        """This DP replica's slice of a global batch."""
        return tensor.chunk(self.o.dp)[self.replica].to(self.device)

    def step(self, step: int) -> float:
        """One optimizer step on global batch ``step``; the global mean loss."""
        x, y = (self.share(t) for t in global_batch(self.o, step))
        if self.o.pp > 1:
            micro: list = []
            self.model.step(x, target=y, losses=micro)
            loss = torch.stack(micro).mean().detach() if micro else None
        else:
            loss = loss_fn(self.model(x), y)
            loss.backward()
            loss = loss.detach()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return _mean_over_replicas(loss, self.device)


def train(o: argparse.Namespace, display: bool = True) -> tuple[Trainer, list[float]]:
    """Train on this rank's share: (the trainer, the global mean loss of each step)."""
    trainer, losses = Trainer(o), []
    with _Display(o, display and dist.get_rank() == 0) as show:
        for step in range(o.steps):
            start = time.perf_counter()
            losses.append(trainer.step(step))
            show(step, losses[-1], o.batch * o.seq / (time.perf_counter() - start))
    return trainer, losses


def _mean_over_replicas(loss: torch.Tensor | None, device: str) -> float:
    """The global batch's loss: every rank that holds a loss (the last stage's) contributes once, and
    each replica has as many such ranks as the others."""
    total = torch.tensor([0.0 if loss is None else loss.item(), float(loss is not None)], device=device)
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def reference(o: argparse.Namespace) -> tuple[torch.nn.Module, list[float]]:
    """The same training in one process on the whole batch: (the model, its losses)."""
    model = build(o)
    return model, train_whole(o, model, torch.optim.AdamW(model.parameters(), lr=o.lr), range(o.steps))


def train_whole(o: argparse.Namespace, model: torch.nn.Module, optimizer, steps) -> list[float]:
    """Steps ``steps`` on whole global batches (one process, or TP alone): their losses."""
    losses = []
    for step in steps:
        x, y = global_batch(o, step)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _peak_memory_mb() -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak RSS (Linux reports KiB)


class _Display:
    """A rich progress bar with one line per step, on rank 0 only."""

    def __init__(self, o: argparse.Namespace, enabled: bool):
        self.enabled, self.steps = enabled, o.steps
        self.title = f"TP {o.tp} x DP {o.dp} ({o.data_parallel}) x PP {o.pp}"

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
            self.progress = Progress(TextColumn(self.title), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[status]}"))
            self.progress.__enter__()
            self.task = self.progress.add_task("train", total=self.steps, status="")
        return self

    def __call__(self, step: int, loss: float, tokens_per_second: float) -> None:
        if self.enabled:
            line = (f"step {step + 1:4d}  loss {loss:.4f}  {tokens_per_second:9.0f} tokens/s  "
                    f"peak memory {_peak_memory_mb():.0f} MB")
            self.progress.console.print(line)
            self.progress.update(self.task, advance=1, status=f"loss {loss:.4f}")

    def __exit__(self, *exc):
        if self.enabled:
            self.progress.__exit__(*exc)


def _run(rank: int, world: int, o: argparse.Namespace) -> list[float]:
    return train(o)[1]


def main(argv=None) -> None:
    o = parse(argv)
    if "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        losses = train(o)[1]
        dist.destroy_process_group()
    else:
        from autotp.tools.spawn import run_local
        losses = run_local(o.tp * o.dp * o.pp, _run, o)[0]
    if o.check and int(os.environ.get("RANK", 0)) == 0:
        expected = reference(o)[1]
        same = all(abs(a - b) <= 1e-4 * abs(b) + 1e-5 for a, b in zip(losses, expected, strict=True))
        print(f"one process: {' '.join(f'{v:.4f}' for v in expected)}; same losses: {same}")


if __name__ == "__main__":
    main()
