"""Serving throughput: output tokens/s and time to first token at 1, 8 and 32 concurrent requests, autotp serve
against transformers' own continuous batching (its manager, ``init_continuous_batching``, with its tp_plan): same
model, same ranks, one run.

    OMP_NUM_THREADS=1 python benchmarks/serve_throughput.py [--world-size 2] [--hidden 256] [--tokens 32]

autotp is measured through its HTTP server and the openai client (streamed, so the first token's time is seen), and
its engine in process driven as transformers' manager is, with no HTTP between the client and it (like with like).
Prints one table; the numbers are for the machine it runs on (docs/serving.md gives a dated run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import describe

from tests.helpers.serving import Server, save_model

CONCURRENCY = (1, 8, 32)


def _prompts(count: int, vocab: int) -> list[str]:
    return [" ".join(f"w{10 + (7 * i + 3 * k) % (vocab - 10)}" for k in range(8 + i % 24)) for i in range(count)]


def measure_autotp(directory: Path, world: int, tokens: int, vocab: int) -> dict:
    import openai

    results = {}
    with Server(directory, "--max-num-seqs", "32", world=world) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        client.completions.create(model=directory.name, prompt="w10 w11", max_tokens=2)  # warm

        def one(prompt: str) -> tuple[float, float, int]:
            start = time.perf_counter()
            first, count = None, 0
            for chunk in client.completions.create(
                model=directory.name,
                prompt=prompt,
                max_tokens=tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
                stream_options={"include_usage": True},
            ):
                if chunk.choices and chunk.choices[0].text and first is None:
                    first = time.perf_counter() - start
                if chunk.usage:
                    count = chunk.usage.completion_tokens
            return first or 0.0, time.perf_counter() - start, count

        for concurrent in CONCURRENCY:
            prompts = _prompts(max(concurrent, 8) * 2, vocab)
            start = time.perf_counter()
            with ThreadPoolExecutor(concurrent) as pool:
                done = list(pool.map(one, prompts))
            wall = time.perf_counter() - start
            assert all(d[2] == tokens for d in done), "a request ended short"
            results[concurrent] = {
                "tokens_per_s": sum(d[2] for d in done) / wall,
                "ttft_ms": 1e3 * statistics.median(d[0] for d in done),
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32, help="output tokens a request")
    args = parser.parse_args()
    vocab = 1000
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "bench-llama"
        save_model(
            directory,
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            vocab_size=vocab,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=512,
        )
        ours = measure_autotp(directory, args.world_size, args.tokens, vocab)
        engine = measure_engine(directory, args.world_size, args.tokens, vocab)
        theirs = measure_transformers(directory, args.world_size, args.tokens, vocab)
    print(describe("gloo"))
    print(
        f"LLaMA hidden {args.hidden}, {args.layers} layers, {args.world_size} ranks, {args.tokens} output tokens a "
        "request"
    )
    print("tokens/s (median time to first token, ms); ratio: autotp's engine / transformers', both in process")
    print(f"{'concurrent':>10} | {'autotp serve (HTTP)':>20} | {'autotp engine':>16} | {'transformers':>16} | ratio")
    for c in CONCURRENCY:
        cells = [f"{r[c]['tokens_per_s']:.1f} ({r[c]['ttft_ms']:.0f})" for r in (ours, engine, theirs)]
        print(
            f"{c:>10} | {cells[0]:>20} | {cells[1]:>16} | {cells[2]:>16} | "
            f"{engine[c]['tokens_per_s'] / theirs[c]['tokens_per_s']:.2f}"
        )


def measure_engine(directory: Path, world: int, tokens: int, vocab: int) -> dict:
    """autotp's engine in process, driven as transformers' manager is (no HTTP): like with like."""
    from autotp.tools.spawn import run_local

    prompts = {c: _prompts(max(c, 8) * 2, vocab) for c in CONCURRENCY}
    return run_local(world, _engine_rank, str(directory), tokens, prompts, timeout=1200)[0]


def _engine_rank(rank: int, world: int, directory: str, tokens: int, prompts: dict) -> dict:
    import queue
    import threading

    from transformers import AutoTokenizer

    import autotp
    from autotp.serving.choices import Request, Sampling
    from autotp.serving.engine import Engine

    sharded = autotp.from_pretrained(directory)
    words = AutoTokenizer.from_pretrained(directory)
    engine = Engine(sharded, words, blocks=1024, block_size=16, max_num_seqs=32, max_batched_tokens=512)
    if rank != 0:
        engine.follow()
        return {}
    loop = threading.Thread(target=engine.run)
    loop.start()
    results = {}
    for concurrent, texts in [(1, ["w10 w11"] * 2), *prompts.items()]:  # the first: a warm-up
        events: queue.Queue = queue.Queue()
        sent, first, done, flying, start = {}, {}, {}, 0, time.perf_counter()
        while len(done) < len(texts):
            while flying < concurrent and len(sent) < len(texts):
                request = Request(
                    words(texts[len(sent)])["input_ids"],
                    Sampling(max_tokens=tokens, temperature=0, ignore_eos=True),
                    events.put,
                )
                request.number = len(sent)
                sent[request.number] = time.perf_counter()
                engine.submit(request)
                flying += 1
            request = events.get()
            first.setdefault(request.number, time.perf_counter() - sent[request.number])
            if request.finished and request.number not in done:
                done[request.number], flying = len(request.choices[0].sequence.output), flying - 1
        wall = time.perf_counter() - start
        assert all(n == tokens for n in done.values()), "a request ended short"
        results[concurrent] = {
            "tokens_per_s": sum(done.values()) / wall,
            "ttft_ms": 1e3 * statistics.median(first.values()),
        }
    engine.stop()
    loop.join()
    return results


def measure_transformers(directory: Path, world: int, tokens: int, vocab: int) -> dict:
    """transformers' continuous batching on the same directory and ranks: ``from_pretrained`` with its tp_plan
    (``DistributedConfig(tp_size=world)``) on gloo processes, then its manager (``init_continuous_batching``) kept
    ``concurrent`` requests in flight, a new one added as each finishes, streamed (the first token's time seen)."""
    from autotp.tools.spawn import run_local

    prompts = {c: _prompts(max(c, 8) * 2, vocab) for c in CONCURRENCY}
    return run_local(world, _transformers_rank, str(directory), tokens, prompts, timeout=1200)[0]


def _transformers_rank(rank: int, world: int, directory: str, tokens: int, prompts: dict) -> dict:
    import torch
    from transformers import AutoTokenizer, DistributedConfig, GenerationConfig, LlamaForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = LlamaForCausalLM.from_pretrained(
        directory, distributed_config=DistributedConfig(tp_size=world), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    words = AutoTokenizer.from_pretrained(directory)
    results = {}
    for concurrent, texts in [(1, ["w10 w11"] * 2), *prompts.items()]:  # the first: a warm-up
        ids = [words(t)["input_ids"] for t in texts]
        manager = model.init_continuous_batching(
            generation_config=GenerationConfig(max_new_tokens=tokens, do_sample=False, eos_token_id=-1, pad_token_id=0),
            continuous_batching_config=ContinuousBatchingConfig(
                page_size=16, num_blocks=1024, max_batch_tokens=512, allow_block_sharing=False, use_cuda_graph=False
            ),
        )
        manager.start()
        if not manager.is_tp_driver:  # another rank: it follows the driver until the group's stop
            manager._generation_thread.join()
            manager.stop(block=True)
            manager.destroy()
            continue
        sent, first, done, flying, start = {}, {}, {}, 0, time.perf_counter()
        while len(done) < len(ids):
            while flying < concurrent and len(sent) < len(ids):
                name = f"r{len(sent)}"
                sent[name] = time.perf_counter()
                manager.add_request(ids[len(sent) - 1], request_id=name, max_new_tokens=tokens, streaming=True)
                flying += 1
            out = manager.get_result(timeout=1.0)
            if out is None:
                continue
            if out.generated_tokens and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - sent[out.request_id]
            if out.is_finished():
                done[out.request_id], flying = len(out.generated_tokens), flying - 1
        wall = time.perf_counter() - start
        assert all(n == tokens for n in done.values()), "a request ended short"
        manager.stop(block=True, timeout=10)
        manager.destroy()
        results[concurrent] = {
            "tokens_per_s": sum(done.values()) / wall,
            "ttft_ms": 1e3 * statistics.median(first.values()),
        }
    return results


if __name__ == "__main__":
    main()
