"""Train a small LLaMA on a mesh of tensor (inside a node) x data x pipeline parallelism.

    torchrun --nproc-per-node 4 examples/train.py --tp 2 --dp 2            # one node, 4 GPUs (or CPU gloo)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/train.py --tp 8 --dp 2                                     # 2 nodes x 8 GPUs
    python examples/train.py --tp 2 --dp 2 --check                         # 4 local gloo ranks, compared
                                                                            # with one process
    python examples/train.py --tp 2 --pp 2 --meta --checkpoint DIR         # built on meta, each rank reads
                                                                            # only its pieces of DIR
    python examples/train.py --tp 8 --dp 16 --pp 8 --dry-run --world-size 1024 --rank 1023   # one process
                                                                            # plays rank 1023 (fake backend)
Every rank builds the same model (fixed seed) and reads the same global batch for each step; each DP
replica takes its slice.  ``autotp.parallelize(model, args, mesh=mesh)`` plans TP on the "tp"
dimension and shards with FSDP2 over "dp"; with ``--pp N`` it splits the model into pipeline stages
(``loss_fn`` and the ``step`` API).  With ``--meta`` the model is built on the meta device and each rank
fills only its own pieces: from ``--checkpoint``, or the model's initialisation seeded by ``--seed``.
Rank 0 prints loss, tokens/s and peak memory per step.
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
from torch.distributed.tensor import DTensor

import autotp
from autotp.runtime.devices import device_of
from autotp.runtime.materialize import initialize


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
    p.add_argument("--warmup", type=int, default=0, help="steps of linear learning-rate warm-up (a scheduler)")
    p.add_argument("--save-dir", help="save the training state here and resume from its newest complete checkpoint")
    p.add_argument("--save-every", type=int, default=100, help="steps between checkpoints (with --save-dir)")
    p.add_argument("--keep", type=int, help="checkpoints to keep, the newest (with --save-dir; default: all)")
    p.add_argument("--check", action="store_true", help="also train in one process and compare the losses")
    p.add_argument("--meta", action="store_true", help="build on the meta device; each rank fills only its pieces")
    p.add_argument("--checkpoint", help="weights to load: a safetensors directory (transformers' save_pretrained)")
    p.add_argument("--seed", type=int, default=0, help="--meta without --checkpoint: the initialisation's seed")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="play one rank of the mesh on PyTorch's fake backend "
        "(no GPUs, no weights) and print what it holds, term by term, beside the planner's figure for each",
    )
    p.add_argument("--world-size", type=int, help="the ranks a dry run plays one of (default: tp x dp x pp)")
    p.add_argument("--rank", type=int, default=0, help="the rank a dry run plays")
    return p.parse_args(argv)


def build(o: argparse.Namespace, meta: bool = False) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=o.vocab,
        hidden_size=o.hidden,
        intermediate_size=2 * o.hidden,
        num_hidden_layers=o.layers,
        num_attention_heads=o.heads,
        num_key_value_heads=o.kv_heads,
        max_position_embeddings=max(64, o.seq),
        use_cache=False,
    )
    with torch.device("meta" if meta else "cpu"):
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
        raise SystemExit(
            f"--tp {o.tp} x --dp {o.dp} x --pp {o.pp} = {o.pp * o.dp * o.tp} ranks, but "
            f"{dist.get_world_size()} were started"
        )
    return init_device_mesh(device, tuple(sizes[d] for d in dims), mesh_dim_names=tuple(dims))


class Trainer:
    """This rank's parallel model and optimizer on the mesh ``o`` asks for."""

    def __init__(self, o: argparse.Namespace):
        if o.batch % o.dp:
            raise SystemExit(f"--batch {o.batch} must divide by --dp {o.dp}")
        self.o = o
        self.device = device_of(dist.group.WORLD).type  # where the group's backend carries tensors: a GPU if any
        self.mesh = make_mesh(o, self.device)
        self.replica = self.mesh["dp"].get_local_rank() if "dp" in self.mesh.mesh_dim_names else 0
        options = {"loss_fn": loss_fn, "schedule": o.schedule, "microbatches": o.microbatches} if o.pp > 1 else {}
        if o.checkpoint or (o.meta and not o.dry_run):  # a dry run keeps every piece on meta
            options.update({"checkpoint": o.checkpoint} if o.checkpoint else {"init_seed": o.seed})
        model = build(o, meta=o.meta or o.dry_run)
        model = model if model.device.type == "meta" else model.to(self.device)
        self.model = autotp.parallelize(
            model, (self.share(global_batch(o, 0)[0]),), mesh=self.mesh, data_parallel=o.data_parallel, **options
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr)
        self.scheduler = schedule(o, self.optimizer)

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
        self.scheduler.step()
        self.optimizer.zero_grad()
        return _mean_over_replicas(loss, self.device)


def schedule(o: argparse.Namespace, optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up over ``--warmup`` steps, then the constant ``--lr``."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: min(1.0, (done + 1) / (o.warmup + 1)))


def train(o: argparse.Namespace, display: bool = True) -> tuple[Trainer, list[float]]:
    """Train on this rank's share: (the trainer, the global mean loss of each step this process ran).  With
    ``--save-dir`` the run resumes from the directory's newest complete checkpoint (model, AdamW, scheduler,
    step, random generators), saves every ``--save-every`` steps, and on SIGTERM saves and stops."""
    from autotp.runtime.run_checkpoints import RunCheckpoints

    show_here = display and dist.get_rank() == 0
    with _bars(show_here):  # capturing, solving, loading: before the steps' own display
        trainer, losses = Trainer(o), []
        saves = RunCheckpoints(o.save_dir, o.save_every, o.keep) if o.save_dir else None
        state = {"scheduler": trainer.scheduler}
        first = saves.resume(trainer.model, trainer.optimizer, **state) if saves else 0
    if first and show_here:
        print(f"resumed from {saves.complete()[-1]}: {first} steps done", flush=True)
    with _Display(o, show_here, first) as show:
        for step in range(first, o.steps):
            start = time.perf_counter()
            losses.append(trainer.step(step))
            show(step, losses[-1], o.batch * o.seq / (time.perf_counter() - start))
            if saves and saves.after(step, trainer.model, trainer.optimizer, **state):
                if show_here:
                    print(f"stopped by SIGTERM after step {step + 1}: saved to {saves.complete()[-1]}", flush=True)
                break
    if saves:
        saves.close()
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
    if o.checkpoint:
        model = type(model).from_pretrained(o.checkpoint)
    elif o.meta:
        initialize(model, o.seed)  # what every rank's pieces were filled with
    return model, train_whole(o, model, torch.optim.AdamW(model.parameters(), lr=o.lr), range(o.steps))


def train_whole(o: argparse.Namespace, model: torch.nn.Module, optimizer, steps, scheduler=None) -> list[float]:
    """Steps ``steps`` on whole global batches (one process, or TP alone): their losses."""
    losses, scheduler = [], scheduler or schedule(o, optimizer)
    for step in steps:
        x, y = global_batch(o, step)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _peak_memory_mb() -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak RSS (Linux reports KiB)


def _bars(enabled: bool):
    """Rich bars for autotp's long steps (capture, solve, a checkpoint load) on a terminal's stderr."""
    import contextlib

    from rich.console import Console

    from autotp.tools.progress_bars import progress_bars

    return progress_bars(Console(stderr=True)) if enabled else contextlib.nullcontext()


class _Display:
    """A rich progress bar with one line per step, on rank 0 only."""

    def __init__(self, o: argparse.Namespace, enabled: bool, done: int = 0):
        self.enabled, self.steps, self.done = enabled, o.steps, done
        self.title = f"TP {o.tp} x DP {o.dp} ({o.data_parallel}) x PP {o.pp}"

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.progress = Progress(
                TextColumn(self.title), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}")
            )
            self.progress.__enter__()
            self.task = self.progress.add_task("train", total=self.steps, completed=self.done, status="")
        return self

    def __call__(self, step: int, loss: float, tokens_per_second: float) -> None:
        if self.enabled:
            line = (
                f"step {step + 1:4d}  loss {loss:.6f}  {tokens_per_second:9.0f} tokens/s  "
                f"peak memory {_peak_memory_mb():.0f} MB"
            )
            self.progress.console.print(line)
            self.progress.update(self.task, advance=1, status=f"loss {loss:.4f}")

    def __exit__(self, *exc):
        if self.enabled:
            self.progress.__exit__(*exc)


def dry_run(o: argparse.Namespace) -> dict:
    """Rank ``o.rank`` of the mesh on PyTorch's fake backend (collectives do nothing, so one process can play any
    rank of any size): what it holds on meta, term by term (cost_models/memory.RankMemory), beside the planner's
    figure for each term of the same layout, micro-batching, schedule and stages, on the same pipeline rank."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = o.world_size or o.tp * o.dp * o.pp
    dist.init_process_group("fake", store=FakeStore(), rank=o.rank, world_size=world)
    with _bars(True):  # rich redirects stdout while it draws: the report is printed after
        held, report = _measure(o, world)
    print(report)
    dist.destroy_process_group()
    return held


# what each term of the dry run is, where it is not a count of what the rank holds on meta
TERM_NOTES = {
    "gradients": "as the optimizer reads them (on meta)",
    "gathered_parameters": "FSDP's unsharded copies and all-gather buffers, during a step only",
    "gathered_gradients": "unsharded gradients and the reduce-scatter input, during a step only",
    "activations": "micro-batches in flight at the schedule's peak: {flight:g} (on meta: from the stage plans)",
    "dispatch": "expert all-to-all buffers, during a step only",
}


def _measure(o: argparse.Namespace, world: int) -> tuple[dict, str]:
    from autotp.cost_models.schedule_tables import in_flight

    start = time.perf_counter()
    trainer = Trainer(o)
    built = time.perf_counter() - start
    model = trainer.model
    stages = list(model.modules.values()) if o.pp > 1 else [model]
    pp_rank = trainer.mesh["pp"].get_local_rank() if o.pp > 1 else 0
    microbatches, virtual = (o.microbatches or o.pp) if o.pp > 1 else 1, len(stages)
    size = o.batch // o.dp // microbatches
    flight = in_flight(o.schedule if o.pp > 1 else None, o.pp, microbatches, pp_rank, virtual)
    held = {
        "parameters": _nbytes(p for m in stages for p in m.parameters()),
        **_optimizer_on_meta(trainer.optimizer),
        "activations": flight * sum(sum(m.autotp_plan.cost["activations"].values()) for m in stages),
        "buffers": _nbytes(b for m in stages for b in m.buffers()),
    }
    planned, peak, why = _planned(o, world, model, microbatches, size, pp_rank)
    title = (
        f"rank {o.rank} of {world} (TP {o.tp} x DP {o.dp} x PP {o.pp}"
        + (f", pipeline rank {pp_rank}, {o.schedule}, {microbatches} micro-batches of {size}" if o.pp > 1 else "")
        + f"), built on meta in {built:.1f} s\nbytes by term, held on meta | the planner's for this rank"
        + (f" ({why})" if why else "")
    )
    lines = [title]
    for term in [*planned] if planned else [*held, "total"]:
        mine = held.get(term, sum(held.values()) if term == "total" else None)
        note = TERM_NOTES.get(term, "").format(flight=flight)
        lines.append(
            f"  {term.replace('_', ' '):<20} {_mib(mine):>12} | {_mib(planned.get(term) if planned else None):>12}"
            + (f"   {note}" if note else "")
        )
    if peak:
        lines.append(f"the planner's peak over the pipeline ranks: {peak}")
    return held, "\n".join(lines)


def _planned(o: argparse.Namespace, world: int, model, microbatches: int, size: int, pp_rank: int):
    """(the planner's RankMemory terms of this pipeline rank, with "total"; its largest total over the pipeline ranks
    and which; why where it cannot price, with None)."""
    from autotp.cost_models import load_topology
    from autotp.cost_models.mesh_layout import Candidate
    from autotp.passes.fold import sections
    from autotp.passes.prepared_graph import prepared_graph
    from autotp.planning.mesh_search import price_layout

    gm = prepared_graph(build(o, meta=True), (global_batch(o, 0)[0][:2],), None, fold=True)
    _, blocks, folded = sections(gm)
    if o.pp > 1 and folded is None:
        return None, "", "the planner prices pipeline stages between a folded graph's blocks: at least 5 of them"
    ends = [*model.starts[1:], blocks] if o.pp > 1 else []
    layout = Candidate(
        o.tp,
        o.pp,
        o.dp,
        microbatch_size=size,
        schedule=o.schedule if o.pp > 1 else None,
        virtual_stages=len(model.modules) if o.pp > 1 else 1,
        stages=[[a, b] for a, b in zip(model.starts, ends, strict=True)] if o.pp > 1 else [],
    )
    nodes = -(-world // load_topology(None).gpus_per_node)
    priced = price_layout(gm, layout, global_batch=o.batch, data_parallel=o.data_parallel, nodes=nodes)
    terms = priced.memory[pp_rank]
    top = max(range(o.pp), key=lambda i: priced.memory[i].total)
    peak = f"{_mib(priced.memory[top].total)} (pipeline rank {top})" if o.pp > 1 else ""
    return {**terms.terms(), "total": terms.total}, peak, ""


def _optimizer_on_meta(optimizer) -> dict:
    """The gradients an AdamW step reads and the state it creates, counted from one step on meta (zeros as
    gradients; the step's counters, on the CPU, are left out)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    grads = _nbytes(p.grad for p in params)
    optimizer.zero_grad()
    state = (t for per in optimizer.state.values() for t in per.values() if isinstance(t, torch.Tensor) and t.dim())
    return {"gradients": grads, "optimizer": _nbytes(state)}


def _nbytes(tensors) -> float:
    """Bytes of this rank's own pieces (FSDP2's shards are DTensors)."""
    return float(sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors))


def _mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.{1 if nbytes >= 2**20 else 3}f} MiB"


def _run(rank: int, world: int, o: argparse.Namespace) -> list[float]:
    return train(o)[1]


def main(argv=None) -> None:
    o = parse(argv)
    if o.dry_run:
        dry_run(o)
        return
    if "WORLD_SIZE" in os.environ:  # torchrun
        # keys of this attempt only: a group torchrun restarts must not read the failed attempt's addresses
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent serves the store
        store = dist.PrefixStore(
            f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
            dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=not hosted and rank == 0
            ),
        )
        dist.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo", store=store, rank=rank, world_size=world
        )
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
