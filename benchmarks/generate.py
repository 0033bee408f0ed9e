"""Tokens per second: autotp.generate vs transformers' tp_plan="auto" generate, same weights, 2 gloo ranks.

    python benchmarks/generate.py [--layers 4] [--hidden 512] [--new 32] [--batch 4]

Each side generates once to warm up (autotp captures and plans its decode program then), then once
timed; greedy, the same prompts.  Prints tokens/s for both and the ratio; fails if autotp's tokens
differ from the unsharded model's greedy generation.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
from machine import describe
from saved_llama import run_on_saved_llama


def _rank(rank: int, world: int, directory: str, batch: int, new: int) -> dict:
    import transformers

    import autotp
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    prompts = torch.randint(3, 1000, (batch, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(prompts)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, tp_plan="auto").eval()
    sharded = autotp.from_pretrained(directory)
    timings = {}
    for name, run in (("hf", lambda n: hf.generate(prompts, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                                   do_sample=False, pad_token_id=0)),
                      ("autotp", lambda n: autotp.generate(sharded, prompts, mask, max_new_tokens=n, eos_token_id=[]))):
        with torch.no_grad():
            run(new)  # warm-up: autotp builds its decode program for this batch and length here
            torch.distributed.barrier()
            start = time.perf_counter()
            tokens = run(new)
            torch.distributed.barrier()
        timings[name] = (time.perf_counter() - start, tokens.shape[1] - prompts.shape[1])
    unsharded = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    want = unsharded.generate(prompts, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0)
    assert torch.equal(tokens, want), "autotp's greedy tokens differ from the unsharded model's"
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    timings = run_on_saved_llama(args.layers, args.hidden, _rank, args.batch, args.new)
    rates = {name: args.batch * new / seconds for name, (seconds, new) in timings.items()}
    print(f"{describe('gloo')}; 2 ranks, {args.layers} layers, hidden {args.hidden}")
    for name, rate in rates.items():
        seconds, new = timings[name]
        print(f"{name:7s} {rate:8.1f} tokens/s ({args.batch} x {new} new tokens in {seconds:.2f} s)")
    print(f"autotp / hf: {rates['autotp'] / rates['hf']:.2f}x the tokens per second")


if __name__ == "__main__":
    main()
