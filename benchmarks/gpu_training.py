"""benchmarks/gpu.py's ``training`` section: one TP-8 rank's slice of a LLaMA-3-8B-shaped training step with
sequence parallelism, compiled, on a fake process group standing for rank 0 of 8 (collectives are traced and
compiled, never run: the time is the rank's compute), against the plan's estimate and the model's FLOPs (MFU on
the card's bf16 peak); and the count of all-gather -> matmul and matmul -> reduce-scatter pairs inductor's
micro-pipeline TP pass fuses into ``symm_mem`` ops in its graphs (run on copies with NCCL and symmetric memory
reported available, tests/helpers/async_tp.py: a fake group has no symmetric memory to run them on).

Runs in a process of its own (its default process group is the fake one).  On a CPU it rehearses at tiny sizes.
"""

from __future__ import annotations

import multiprocessing
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORLD = 8


def training(
    seq: int = 4096,
    layers: int = 4,
    hidden: int = 4096,
    heads: int = 32,
    kv: int = 8,
    ffn: int = 14336,
    vocab: int = 128256,
) -> dict:
    sizes = {"seq": seq, "layers": layers, "hidden": hidden, "heads": heads, "kv": kv, "ffn": ffn, "vocab": vocab}
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=_rank_zero, args=(sizes, queue))
    process.start()
    ok, result = queue.get(timeout=3000)
    process.join(timeout=60)
    if not ok:
        raise RuntimeError(result)
    return result


def _rank_zero(sizes: dict, queue) -> None:
    import traceback

    try:
        queue.put((True, _measured(**sizes)))
    except Exception:
        queue.put((False, traceback.format_exc()))


def _measured(seq: int, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int) -> dict:
    import torch.distributed as dist
    from gpu import DEVICE, _timed, card
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import LlamaConfig, LlamaForCausalLM

    import autotp
    from autotp.cost_models import load_topology
    from tests.helpers.async_tp import counting_compile

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=seq,
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).train()
    ids = torch.randint(0, vocab, (1, seq), device=DEVICE)
    sharded = autotp.parallelize(
        model, (ids,), topology=card(), sequence_parallel=True, init_seed=0, device=DEVICE, check_inputs=False
    )
    estimate = sharded.autotp_plan.cost["seconds"]
    linear = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
    flops = (6 * seq * linear + 6 * 2 * layers * seq * seq * hidden) / WORLD  # this rank's share, attention unmasked
    peak = load_topology(card()).peak_flops
    with counting_compile(sharded) as (compiled, fused):
        start = time.perf_counter()

        def step():
            compiled(ids).logits.float().mean().backward()

        seconds = _timed(step, warmup=2, repeat=5)
    out = {
        "tokens": seq,
        "layers": layers,
        "step_s": round(seconds, 5),
        "estimate_s": estimate,
        "vs_estimate": round(seconds / estimate, 3),
        "mfu": round(flops / seconds / peak, 3),
        "fused_symm_mem_ops": {phase: dict(counts) for phase, counts in fused.items()},
        "compile_and_timing_s": round(time.perf_counter() - start, 1),
    }
    print(
        f"  TP-8 rank 0, SP, compiled: {seconds * 1e3:.2f} ms ({out['vs_estimate']:.2f} x the estimate "
        f"{estimate * 1e3:.2f} ms), MFU {out['mfu']:.3f}; fused symm_mem ops {out['fused_symm_mem_ops']}",
        flush=True,
    )
    return out
