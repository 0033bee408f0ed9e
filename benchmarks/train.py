"""One AdamW training step on TP 2 x DP 2 (4 gloo ranks): per-rank peak memory (MemTracker) and step time of
autotp against a torchtitan-style hand-written DTensor plan of the same model, same mesh, same batch, in one run.

    python benchmarks/train.py [--layers 8] [--hidden 256] [--seq 128] [--batch 8] [--repeats 10] [--runs 3]
                               [--compile]

The hand-written plan is Megatron's, as torchtitan writes it for LLaMA: ``parallelize_module`` with q/k/v and
gate/up ``ColwiseParallel``, o/down ``RowwiseParallel``, the embedding ``RowwiseParallel`` and the head
``ColwiseParallel`` gathering the logits; then FSDP2 ``fully_shard`` on every block and the root over "dp", with
the same explicit prefetch autotp sets (each block prefetches the next one's all-gather in the forward, the
previous one's in the backward).  It runs twice: without sequence parallelism, and with it as torchtitan ships
it (norms ``SequenceParallel``, the residual stream split by tokens).  autotp: ``autotp.parallelize(model, args,
mesh=mesh)`` (its plan on "tp", FSDP2 per block and at the root on "dp"), its own choice and with
``sequence_parallel=True``; its own choice runs twice, with its gloo collectives (one-shot small all-reduces,
polled waits) and with the plain functional c10d ops DTensor uses.  Ratios compare like with like: autotp's
choice with the plain plan, autotp's sequence parallelism with torchtitan's.

Memory: after a warm-up step (the optimizer state exists), one step under
``torch.distributed._tools.mem_tracker.MemTracker`` per runner; the peak of the rank that peaks highest, with
its breakdown, and the planner's estimate for the same layout (``autotp.plan_mesh``'s per-device pricing).
Compiled code runs outside MemTracker's dispatch mode, so every run also reads one step's peak off
``torch.profiler``'s memory events (what the rank holds before the step plus the largest running sum of what
the ops allocate net): compiled runs report that one, eager runs both, which shows how far the two agree.
Time: the runners alternate step by step, medians per run.  Every run (``--runs``, fresh processes) prints its
numbers, then the range over runs.  Both start from the same weights; their first losses are checked equal.
``--compile``: every runner compiled per block as torchtitan compiles (``torch.compile(block, fullgraph=True)``):
the hand-written plan's blocks before ``fully_shard``, autotp's FSDP units (``sharded.autotp_units``) after
``parallelize``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from machine import describe

from examples.train import build, global_batch, loss_fn, parse

SP, HAND_SP = "autotp, sequence parallel", "hand-written, seq. parallel"
# (what is compared, autotp's runner, the hand-written one): like with like
PAIRS = (("", "autotp", "hand-written"), (", plain c10d", "autotp, plain c10d", "hand-written"), (" (SP)", SP, HAND_SP))
KINDS = ("Parameter", "Gradient", "Optstate", "Activation", "Temp", "Buffer")


def hand_written(
    model: torch.nn.Module, mesh, compiled: bool = False, sequence_parallel: bool = False
) -> torch.nn.Module:
    """torchtitan's LLaMA plan on the "tp" dimension, FSDP2 per block and at the root on "dp", with prefetch;
    ``compiled``: each block compiled before ``fully_shard``, as torchtitan's ``apply_compile``;
    ``sequence_parallel``: torchtitan's plan as it ships (norms ``SequenceParallel``, the residual stream split by
    tokens between blocks; transformers' LLaMA reads the sequence length off the embedding's output, so that
    stays a DTensor, as do the row-parallel outputs added to it)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tokens = {"output_layouts": Shard(1), "use_local_output": False} if sequence_parallel else {}
    parallelize_module(
        model,
        mesh["tp"],
        {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), **tokens),
            "lm_head": ColwiseParallel(
                input_layouts=Shard(1) if sequence_parallel else Replicate(), output_layouts=Replicate()
            ),
            **({"model.norm": SequenceParallel()} if sequence_parallel else {}),
        },
    )
    gathered = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
        ),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    }
    blocks = list(model.model.layers)
    for block in blocks:
        parallelize_module(
            block,
            mesh["tp"],
            {
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(**tokens),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(**tokens),
                **(gathered if sequence_parallel else {}),
            },
        )
        if compiled:
            block.compile(fullgraph=True)
        fully_shard(block, mesh=mesh["dp"])
    for before, after in itertools.pairwise(blocks):
        before.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([before])
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


def _peak(model, optimizer, x, y) -> dict:
    """MemTracker's peak of one step: bytes by kind and their total."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer, x)
    with tracker:  # one step per tracker
        _step(model, optimizer, x, y)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return {"Total": peak["Total"], **{k: peak.get(k, 0) for k in KINDS}}


def _held(model, optimizer) -> int:
    """Bytes of the storages a rank holds between steps: its parameters' pieces, gradients, optimizer state and
    buffers (each storage once)."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    storages = {}
    for t in tensors:
        storage = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _profiled_peak(model, optimizer, x, y) -> int:
    """The peak of one step read from torch.profiler's memory events, for compiled code (MemTracker, a dispatch
    mode, cannot follow it): what the rank holds before the step plus the largest running sum of the bytes every
    op allocates net of what it frees, in the order the ops end (an op's own transient peak is not seen)."""
    start = _held(model, optimizer)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(model, optimizer, x, y)
    live = peak = 0
    for event in sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.end):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return start + peak


def compiled_units(sharded: torch.nn.Module) -> torch.nn.Module:
    """autotp's FSDP units (one per block) each compiled on its own, as torchtitan compiles its blocks."""
    for path in sharded.autotp_units:
        sharded.get_submodule(path).compile(fullgraph=True)
    return sharded


def run(rank: int, world: int, o: argparse.Namespace, repeats: int, compiled: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import autotp
    from autotp.runtime.transport import register

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x, y = (t.chunk(2)[mesh["dp"].get_local_rank()] for t in global_batch(o, 0))
    plain = autotp.parallelize(build(o), (x,), mesh=mesh)
    register(plain.autotp_group, shortcuts=False)  # its TP collectives as DTensor runs them
    runners = {
        "autotp": autotp.parallelize(build(o), (x,), mesh=mesh),
        "autotp, plain c10d": plain,
        "hand-written": hand_written(build(o), mesh, compiled),
        SP: autotp.parallelize(build(o), (x,), mesh=mesh, sequence_parallel=True),
        HAND_SP: hand_written(build(o), mesh, compiled, sequence_parallel=True),
    }
    if compiled:
        for name in ("autotp", "autotp, plain c10d", SP):
            runners[name] = compiled_units(runners[name])
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=o.lr) for name, m in runners.items()}
    first = {name: _step(m, optimizers[name], x, y)[1] for name, m in runners.items()}
    if any(abs(loss - first["hand-written"]) > 1e-4 * abs(first["hand-written"]) + 1e-5 for loss in first.values()):
        raise AssertionError(f"the runners disagree on the first loss: {first}")
    # MemTracker is a dispatch mode, which compiled code refuses: compiled runs read the profiler's memory events
    peaks = {name: _peak(m, optimizers[name], x, y) for name, m in runners.items()} if not compiled else None
    profiled = {name: _profiled_peak(m, optimizers[name], x, y) for name, m in runners.items()}
    times: dict = {name: [] for name in runners}
    for _ in range(repeats):
        for name, m in runners.items():
            times[name].append(_step(m, optimizers[name], x, y)[0])
    return {
        "peaks": peaks,
        "profiled": profiled,
        "times": {name: statistics.median(t) for name, t in times.items()},
    }


def _estimate(o: argparse.Namespace) -> float:
    """The planner's bytes per device for TP 2 x DP 2 (FSDP) running each replica's batch at once, as here."""
    from autotp.cost_models.mesh_layout import Candidate
    from autotp.passes.prepared_graph import prepared_graph
    from autotp.planning.mesh_search import price_layout

    gm = prepared_graph(build(o), (global_batch(o, 0)[0][:1],), None, fold=True)
    layout = Candidate(2, 1, 2, microbatch_size=o.batch // 2)
    return price_layout(gm, layout, topology="dgx-h100", global_batch=o.batch, data_parallel="fsdp").memory_bytes


def _fresh_fork_server() -> None:
    """Each run's ranks from a new fork server: compiled, a second run forked from the same one crashed, three
    times of three (SIGSEGV in the first inductor kernel of the hand-written SP block; 2026-12-07)."""
    import multiprocessing.forkserver

    multiprocessing.forkserver._forkserver._stop()  # type: ignore[attr-defined]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8, help="at least 5: the planner's estimate folds the blocks")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch (half per DP replica)")
    p.add_argument("--repeats", type=int, default=10, help="timed steps per runner and run")
    p.add_argument("--runs", type=int, default=1, help="fresh 4-rank runs (the spread over them is printed)")
    p.add_argument("--compile", action="store_true", help="every runner compiled per block (torchtitan's way)")
    a = p.parse_args(argv)
    o = parse(
        [
            "--layers",
            str(a.layers),
            "--hidden",
            str(a.hidden),
            "--seq",
            str(a.seq),
            "--batch",
            str(a.batch),
            "--heads",
            "8",
            "--kv-heads",
            "4",
            "--vocab",
            "1024",
        ]
    )
    from autotp.tools.spawn import run_local

    print(f"{describe('gloo, 4 local ranks')}; {datetime.date.today()}")
    print(
        f"TP 2 x DP 2, LLaMA {a.layers} layers hidden {a.hidden} vocab 1024, global batch {a.batch} x {a.seq}, "
        "one AdamW step" + (", compiled per block" if a.compile else "")
    )
    ratios: dict = {f"{kind}{what}": [] for what, _, _ in PAIRS for kind in ("memory", "memory (profiler)", "time")}
    for k in range(a.runs):
        _fresh_fork_server()
        results = run_local(4, run, o, a.repeats, a.compile, timeout=900)
        names = list(results[0]["times"])
        step = {n: statistics.median(r["times"][n] for r in results) for n in names}
        profiled = {n: max(r["profiled"][n] for r in results) for n in names}
        for n in names:
            if results[0]["peaks"] is None:
                print(
                    f"run {k + 1}: {n:28s} peak {profiled[n] / 2**20:7.2f} MiB (profiler), step "
                    f"{step[n] * 1e3:7.1f} ms (median of {a.repeats})"
                )
                continue
            peak = max(r["peaks"][n]["Total"] for r in results)
            top = max(results, key=lambda r, n=n: r["peaks"][n]["Total"])["peaks"][n]
            parts = ", ".join(f"{kind.lower()} {top[kind] / 2**20:.2f}" for kind in KINDS if top[kind])
            print(
                f"run {k + 1}: {n:28s} peak {peak / 2**20:7.2f} MiB ({parts}; profiler "
                f"{profiled[n] / 2**20:.2f}), step {step[n] * 1e3:7.1f} ms "
                f"(median of {a.repeats})"
            )
        for what, ours, theirs in PAIRS:
            if results[0]["peaks"] is not None:
                peaks = {n: max(r["peaks"][n]["Total"] for r in results) for n in (ours, theirs)}
                ratios[f"memory{what}"].append(peaks[ours] / peaks[theirs])
            ratios[f"memory (profiler){what}"].append(profiled[ours] / profiled[theirs])
            ratios[f"time{what}"].append(step[ours] / step[theirs])
    for what, values in ratios.items():
        if not values:  # memory, when compiled
            continue
        print(f"autotp / hand-written {what}: {min(values):.2f}x .. {max(values):.2f}x over {a.runs} run(s)")
    print(f"planner's estimate for this layout: {_estimate(o) / 2**20:.2f} MiB per device (fp32 AdamW)")
    return ratios


if __name__ == "__main__":
    main()
