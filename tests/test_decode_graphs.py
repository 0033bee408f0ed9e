"""The engine's decode steps at GPU speed, checked on the CPU: decodes run from static buffers padded to batch
buckets, so a compiled engine makes one graph a bucket and its tokens are the eager engine's; and nothing inside a
step waits on the device (no ``.item()``, ``int()``, ``.tolist()`` or data-dependent shape)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.distributed import run_ranks

# ops that make the host wait for a GPU: a value read back, or an output whose size depends on values
SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "equal", "is_nonzero")


class HostSync(AssertionError):
    """Something in a decode step read a device value back on the host."""


class NoHostSync(TorchDispatchMode):
    """Raises on any op that syncs with the host, and on ``Tensor.tolist``/``numpy`` (which bypass dispatch)."""

    def __enter__(self):
        self.saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
        for name in self.saved:
            setattr(torch.Tensor, name, _refuse(name))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self.saved.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        masks = name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())
        )
        if name in SYNCING or masks:  # a boolean mask as an index: its size is its count of True
            raise HostSync(f"{func} inside a decode step")
        return func(*args, **(kwargs or {}))


def _refuse(name: str):
    def refused(*_, **__):
        raise HostSync(f"Tensor.{name} inside a decode step")

    return refused


def test_the_guard_catches_host_syncs():
    x = torch.arange(4.0)
    for sync in (
        lambda: x.sum().item(),
        lambda: int(x[1]),
        lambda: x.tolist(),
        lambda: bool(x.any()),
        lambda: x[x > 1],
    ):
        with pytest.raises(HostSync), NoHostSync():
            sync()
    with NoHostSync():
        torch.where(x > 1, x, 0).argmax()


def _served(rank: int, world: int, backend: str) -> list:
    """The eager engine's run, then the compiled one's, over the same sharded model."""
    import transformers

    import autotp
    from tests.helpers import configs

    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(configs.llama(use_cache=True, max_position_embeddings=128)).eval()
    sharded = autotp.parallelize(model, (torch.zeros(2, 8, dtype=torch.long),))
    return [_engine_run(rank, sharded, None), _engine_run(rank, sharded, backend)]


def _engine_run(rank: int, sharded, backend: str | None) -> list:
    """4 requests of 3 to 6 prompt tokens submitted at once, 12, 24, 36 and 48 tokens long (one sampled with a
    seed): ~50 steps whose decode batch goes 4, 3, 2, 1.  Eager (backend None), every step after the first runs
    under NoHostSync; compiled, the decode graphs made are counted."""
    from autotp.serving import engine as serving
    from autotp.serving.choices import Request, Sampling
    from autotp.serving.decode_graphs import CompileOptions
    from tests.helpers.serving import tokenizer

    vocab = sharded.autotp_source.config.vocab_size
    engine = serving.Engine(
        sharded,
        tokenizer(vocab),
        blocks=32,
        block_size=4,
        max_num_seqs=4,
        max_batched_tokens=16,
        max_model_len=64,
        compile=None if backend is None else CompileOptions(backend=backend),
    )
    sized = None if backend is not None else _profiled(rank, engine, sharded.autotp_source.config)
    if rank != 0:
        engine.follow()
        return []
    steps, step = [], engine._device_step

    def guarded(calls, rows):
        steps.append(sum(r is not None and r.count == 1 for r in rows))
        if backend is not None or len(steps) == 1:  # a program's first call checks its inputs over the group
            return step(calls, rows)
        with NoHostSync():
            return step(calls, rows)

    engine._device_step = guarded
    requests = [
        Request(
            [10 + 7 * i + k for k in range(3 + i)],
            Sampling(
                max_tokens=12 * (i + 1),
                ignore_eos=True,
                **({"temperature": 0.8, "top_k": 20, "seed": 4} if i == 1 else {"temperature": 0}),
            ),
            lambda r: None,
        )
        for i in range(4)
    ]
    for request in requests:
        engine.submit(request)
    loop = threading.Thread(target=engine.run)
    loop.start()
    while not all(r.finished for r in requests):
        loop.join(0.01)
        assert loop.is_alive() or all(r.finished for r in requests), engine.error
    engine.stop()
    loop.join()
    assert engine.error is None
    made = None if backend is None else (engine.decode.compiled, engine.layout.buckets)
    latencies = {name: histogram.count for name, histogram in engine.histograms().items()}
    return [[r.choices[0].sequence.output for r in requests], steps, made, latencies, sized]


class _Memory:
    """A GPU's figures as serving/pool_sizing.py reads them, made up: rank 1's device is the smaller."""

    def __init__(self, rank: int, engine):
        self.total, self.engine, self.reset_before = (400_000, 330_000)[rank], engine, False

    def reset(self):
        self.reset_before = True

    def use(self, profiling_pool: int):
        from autotp.serving.pool_sizing import MemoryUse

        scratch = self.engine.pools()["keys_0"][self.engine.scratch :]
        assert self.reset_before and scratch.abs().sum() > 0, "the profiling step ran after the reset"
        return MemoryUse(self.total, peak=100_000 + profiling_pool, profiling_pool=profiling_pool)


def _profiled(rank: int, engine, config) -> tuple:
    """The eager engine's pool sized by a profiling step at half the made-up devices, then reallocated: 63 blocks,
    what the smaller device leaves ((0.5 × 330,000 − 100,000) // 1,024 bytes a block a rank)."""
    from autotp.serving.pool_sizing import block_bytes, profiled_blocks

    per_block = block_bytes(config, engine.block_size, 2, 4)
    blocks = profiled_blocks(engine, 0.5, per_block, _Memory(rank, engine))
    engine.resize_pool(blocks)
    return blocks, tuple(engine.pools()["keys_0"].shape), engine.scheduler.total, per_block


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_decode_is_a_graph_a_bucket_and_equals_eager(backend):
    """Over ~50 steps whose decode batch varies from 1 to 4: the compiled engine makes at most one decode graph a
    bucket (1, 2, 4), and every token equals the eager engine's, whose steps never sync with the host and whose
    pool was sized by a profiling step and reallocated before it served."""
    (eager, steps, _, latencies, sized), (compiled, _, (made, buckets), _, _) = run_ranks(2, _served, backend)[0]
    assert sized == (63, (64 * 4, 1, 16), 63, 1024)  # the pool and the scheduler as profiling sized them
    assert len(steps) >= 48 and set(steps) >= {1, 2, 3, 4}, steps
    assert buckets == (1, 2, 4) and made <= len(buckets), (made, buckets)
    assert compiled == eager
    assert [len(tokens) for tokens in eager] == [12, 24, 36, 48]
    assert latencies == {"time_to_first_token_seconds": 4, "inter_token_latency_seconds": 120 - 4}


def test_latency_histograms_read_as_prometheus_histograms():
    from autotp.serving.latency_metrics import Histogram

    histogram = Histogram((0.1, 1.0))
    for seconds in (0.05, 0.1, 0.5, 3.0):
        histogram.observe(seconds)
    assert histogram.lines("autotp_ttft_seconds") == [
        "# TYPE autotp_ttft_seconds histogram",
        'autotp_ttft_seconds_bucket{le="0.1"} 2',
        'autotp_ttft_seconds_bucket{le="1.0"} 3',
        'autotp_ttft_seconds_bucket{le="+Inf"} 4',
        "autotp_ttft_seconds_sum 3.65",
        "autotp_ttft_seconds_count 4",
    ]


def test_serve_replays_graphs_on_a_gpu_unless_enforce_eager_and_compiles_on_the_cpu_when_asked():
    """vLLM's flags: on a GPU the decode steps are CUDA graphs by default (--enforce-eager: op by op; --compile:
    inductor's graphs captured); on the CPU eager unless --compile; both flags at once are a usage error."""
    import argparse

    from autotp.serving.decode_graphs import CompileOptions
    from autotp.tools.serve import ServeOptions, add_serve_parser, decode_graphs

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(), int)

    def chosen(*flags: str, device: str):
        args = vars(parser.parse_args(["serve", "m", *flags]))
        options = ServeOptions(
            **{k: v for k, v in args.items() if k in ServeOptions.__dataclass_fields__} | {"world_size": 1}
        )
        return decode_graphs(options, torch.device(device))

    assert chosen(device="cuda") == CompileOptions(backend=None)
    assert chosen("--compile", device="cuda") == CompileOptions(backend="inductor")
    assert chosen("--enforce-eager", device="cuda") is None
    assert chosen(device="cpu") is None and chosen("--compile", device="cpu") == CompileOptions()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "m", "--compile", "--enforce-eager"])


def _reference(q, keys, values, table, positions, block_size, window, softcap):
    """Softmax attention over each row's context copied out of the pool (what the step program did before)."""
    context = (table[:, :, None] * block_size + torch.arange(block_size)).flatten(1)
    group = q.shape[1] // keys.shape[1]
    k, v = (pool[context].transpose(1, 2).repeat_interleave(group, 1) for pool in (keys, values))
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    seen, here = torch.arange(context.shape[1])[None, None, :], positions[:, :, None]
    allowed = (seen <= here) & ((here - seen < window) if window else True)
    return scores.masked_fill(~allowed[:, None], -torch.inf).softmax(-1) @ v


class Largest(TorchDispatchMode):
    """The most elements any op's output holds."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.largest = max(
            [self.largest] + [t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        )
        return out


@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (5, 0.0), (0, 2.0)])
def test_attention_reads_the_pool_a_span_at_a_time_and_equals_softmax_over_the_copied_context(window, softcap):
    """autotp::paged_attention, the step program's attention: grouped KV heads, prompt chunks and decodes, padding
    tables, sliding windows and soft caps give softmax attention over the context copied out of the pool, whatever
    the span of blocks it reads at once; as the op runs on the CPU, no tensor it makes is larger than
    READ_ELEMENTS (half of a row's context copied out here) or the output, and nothing syncs with the host."""
    from autotp.runtime.paged_attention import READ_ELEMENTS, paged_attention, read_in_place, span_of
    from tests.helpers.exact import TOL

    torch.manual_seed(0)
    rows, heads, kv, dim, size, width = 4, 4, 2, 16, 4, 1024
    keys, values = torch.randn(2, 2100 * size, kv, dim).unbind(0)
    table = torch.randperm(2100)[: rows * width // 2].repeat(2).view(rows, width)
    for tokens in (1, 3):  # a decode, a chunk padded on the left (position 0 twice)
        q = torch.randn(rows, heads, tokens, dim)
        positions = torch.tensor([[0, 0, 1], [5, 6, 7], [600, 601, 602], [4093, 4094, 4095]])[:, -tokens:]
        expected = _reference(q, keys, values, table, positions, size, window, softcap)
        span = span_of("cpu", rows, size, kv * dim, heads * tokens)
        assert 1 < span < width
        with NoHostSync(), Largest() as seen:
            got = read_in_place(q, keys, values, table, positions, size, dim**-0.5, window, softcap, span)
        torch.testing.assert_close(got, expected, **TOL)
        assert seen.largest <= max(READ_ELEMENTS["cpu"], q.numel()) == rows * width * size * kv * dim // 2
        op = paged_attention(q, keys, values, table, positions, size, dim**-0.5, window, softcap)
        torch.testing.assert_close(op, expected, **TOL)
        for other in (1, 3, width + 1):
            spanned = read_in_place(q, keys, values, table, positions, size, dim**-0.5, window, softcap, other)
            torch.testing.assert_close(spanned, expected, **TOL)
