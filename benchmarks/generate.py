"""Tokens per second: autotp.generate vs transformers' tp_plan="auto" generate, same weights, 2 gloo ranks.

    python benchmarks/generate.py [--layers 4] [--hidden 512] [--new 32] [--batch 4] [--repeats 3]

Each side generates once to warm up (autotp captures and plans its decode program then), then ``repeats`` times
timed, the sides taking turns; greedy, the same prompts.  autotp runs twice: with its gloo shortcuts (small
all-reduces as one all-gather, polled waits) and with plain collectives, as transformers' DTensor runs them.
Prints the range of tokens/s of each and the ratios of the medians; fails if autotp's tokens differ from the
unsharded model's greedy generation.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from machine import describe
from saved_llama import run_on_saved_llama


def _rank(rank: int, world: int, directory: str, batch: int, new: int, repeats: int) -> dict:
    import transformers

    import autotp

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    prompts = torch.randint(3, 1000, (batch, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(prompts)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, tp_plan="auto").eval()
    sharded = autotp.from_pretrained(directory)
    group = torch.distributed.group.WORLD

    def ours(n, shortcuts: bool):
        (autotp.runtime.transport.register if shortcuts else autotp.runtime.transport.unregister)(group)
        return autotp.generate(sharded, prompts, mask, max_new_tokens=n, eos_token_id=[])

    sides = {
        "hf": lambda n: hf.generate(
            prompts, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        ),
        "autotp": lambda n: ours(n, True),
        "autotp, plain collectives": lambda n: ours(n, False),
    }
    timings: dict = {name: [] for name in sides}
    with torch.no_grad():
        for run in sides.values():
            run(new)  # warm-up: autotp builds its decode program for this batch and length here
        for _ in range(repeats):
            for name, run in sides.items():
                torch.distributed.barrier()
                start = time.perf_counter()
                tokens = run(new)
                torch.distributed.barrier()
                timings[name].append((time.perf_counter() - start, tokens.shape[1] - prompts.shape[1]))
    unsharded = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    want = unsharded.generate(
        prompts, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
    )
    assert torch.equal(tokens, want), "autotp's greedy tokens differ from the unsharded model's"
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    timings = run_on_saved_llama(args.layers, args.hidden, _rank, args.batch, args.new, args.repeats)
    rates = {name: [args.batch * new / seconds for seconds, new in runs] for name, runs in timings.items()}
    print(
        f"{describe('gloo')}; 2 ranks, {args.layers} layers, hidden {args.hidden}, {args.batch} x {args.new} new "
        f"tokens, {args.repeats} runs each"
    )
    for name, runs in rates.items():
        print(f"{name:26s} {min(runs):8.1f} - {max(runs):8.1f} tokens/s (median {statistics.median(runs):.1f})")
    median = {name: statistics.median(runs) for name, runs in rates.items()}
    print(
        f"autotp / hf: {median['autotp'] / median['hf']:.2f}x the tokens per second (medians); with plain "
        f"collectives {median['autotp, plain collectives'] / median['hf']:.2f}x"
    )


if __name__ == "__main__":
    main()
