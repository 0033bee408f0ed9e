"""benchmarks/gpu.py's ``serving`` section: decode speed of a LLaMA-3-8B-shaped model (8 of its 32 layers, random
bf16 weights) on one GPU, against the card's HBM floor and transformers' own compiled static-cache ``generate``.

  decode tokens/s at batch 1 and 32 of ``autotp.generate``: op by op (eager) and with the one-token step replayed
  as a CUDA graph (``compile=CompileOptions(backend=None)``, serving/decode_graphs.py), timed as the difference
  between ``new`` tokens and one (the prompt's step cancels); the HBM floor is the weights and the KV cache read
  once a step at the profile's bandwidth (goal: >= 70% of it at batch 1 with graphs); transformers: ``generate``
  with ``cache_implementation="static"`` and the forward compiled (mode="reduce-overhead"); and one replay under
  ``torch.cuda.set_sync_debug_mode("error")``: nothing in it waits on the host.

On a CPU it rehearses at tiny sizes in fp32 (gloo; transformers compiled with the eager backend, no sync check).
"""

from __future__ import annotations

import time

import torch
from gpu import DEVICE, card


def _llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, context: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context,
        rope_theta=500000.0,
        use_cache=True,
    )
    return LlamaForCausalLM(config).to(DEVICE, dtype).eval()


def _seconds(fn) -> float:
    fn()  # warm: compiles, captures, allocates
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _decode_rate(generate, batch: int, prompt: int, new: int) -> tuple[float, torch.Tensor]:
    """(decode tokens/s, the tokens of the ``new``-token run): ``new`` tokens timed against one."""
    ids = torch.randint(3, 100, (batch, prompt), generator=torch.Generator().manual_seed(batch)).to(DEVICE)
    out = {}

    def run(count: int):
        out[count] = generate(ids, count)

    long, short = _seconds(lambda: run(new)), _seconds(lambda: run(1))
    return batch * (new - 1) / max(long - short, 1e-9), out[new]


def serving(
    layers: int = 8,
    hidden: int = 4096,
    heads: int = 32,
    kv_heads: int = 8,
    ffn: int = 14336,
    vocab: int = 128256,
    batches: tuple = (1, 32),
    prompt: int = 128,
    new: int = 64,
) -> dict:
    import autotp
    from autotp.cost_models import load_topology
    from autotp.serving.decode_graphs import CompileOptions

    model = _llama(layers, hidden, heads, kv_heads, ffn, vocab, prompt + new)
    ids = torch.zeros(1, 8, dtype=torch.long, device=DEVICE)
    sharded = autotp.parallelize(model, (ids,))
    bandwidth = load_topology(card()).hbm_bandwidth
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = hidden // heads
    out: dict = {
        "layers": layers,
        "weights_gb": round(weights / 1e9, 2),
        "hbm_tb_s": bandwidth / 1e12,
        "prompt": prompt,
        "new": new,
    }
    for batch in batches:
        cache = 2 * layers * batch * (prompt + new) * kv_heads * head_dim * model.dtype.itemsize
        floor = batch / ((weights + cache) / bandwidth)
        row: dict = {"hbm_floor_tok_s": round(floor, 1)}
        tokens = {}
        for name, compile in (("eager", False), ("graphs", CompileOptions(backend=None))):
            rate, tokens[name] = _decode_rate(
                lambda x, n, c=compile: autotp.generate(sharded, x, max_new_tokens=n, eos_token_id=[], compile=c),
                batch,
                prompt,
                new,
            )
            row[f"autotp_{name}_tok_s"] = round(rate, 1)
            row[f"autotp_{name}_of_floor"] = round(rate / floor, 3)
        row["equal"] = bool(torch.equal(tokens["eager"], tokens["graphs"]))
        row["transformers_compiled_tok_s"] = round(_transformers_rate(model, batch, prompt, new), 1)
        out[f"batch {batch}"] = row
        print(f"  batch {batch:3d}: {row}", flush=True)
    out["replay_syncs"] = _replay_syncs(sharded, prompt)
    out["equal"] = all(out[f"batch {b}"]["equal"] for b in batches) and out["replay_syncs"] in ("none", "cpu")
    return out


def _transformers_rate(model, batch: int, prompt: int, new: int) -> float:
    """transformers' generate with a static cache and the forward compiled (reduce-overhead: CUDA graphs)."""
    compiled = (
        torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        if DEVICE == "cuda"
        else torch.compile(model.forward, backend="eager")
    )
    forward, model.forward = model.forward, compiled
    try:
        rate, _ = _decode_rate(
            lambda x, n: model.generate(
                x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, cache_implementation="static"
            ),
            batch,
            prompt,
            new,
        )
    finally:
        model.forward = forward
    return rate


def _replay_syncs(sharded, prompt: int) -> str:
    """A one-token step replayed (its CUDA graph already captured) under set_sync_debug_mode("error"): "none" when
    nothing in the replay waits on the host, else the error."""
    if DEVICE != "cuda":
        return "cpu"
    from autotp.serving.generation import _program

    program = _program(sharded, 1, prompt + 4, 4)
    from autotp.serving.decode_graphs import CompileOptions, StepGraphs

    graphs = StepGraphs(program, CompileOptions(backend=None), sharded.autotp_group, torch.device(DEVICE))
    inputs = (
        torch.zeros(1, 1, dtype=torch.long, device=DEVICE),
        torch.ones(1, prompt + 4, dtype=torch.long, device=DEVICE),
        torch.zeros(1, 1, dtype=torch.long, device=DEVICE),
        torch.zeros(1, dtype=torch.long, device=DEVICE),
    )
    for _ in range(2):  # as the program runs, then captured
        graphs(*inputs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graphs(*inputs)
        return "none" if graphs.captured == 1 else f"{graphs.captured} graphs captured"
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
