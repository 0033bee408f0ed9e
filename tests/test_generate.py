"""Generation with a sharded KV cache: token-exact with transformers' generate, same tokens on
every rank, reproducible sampling."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist

import autotp
from autotp.serving.generation import decoder
from tests.helpers.distributed import run_ranks
from tests.helpers.models import build, llama_with, padded_prompts


def _greedy_models() -> tuple:
    return llama_with(heads=8, kv=2, vocab=128, layers=2), build("gpt2")[0]


def _greedy(rank: int, world: int) -> None:
    for model in _greedy_models():
        ids, mask = padded_prompts(128)
        sharded = autotp.parallelize(model, (ids,))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = autotp.generate(sharded, ids, mask, max_new_tokens=8, pad_token_id=0)
        # the cache by the keyword the model takes (transformers 5.24 deprecates past_key_values, 5.40 drops it)
        assert not [w for w in caught if "past_key_values" in str(w.message)]
        want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(got, want), (got, want)
        # the KV cache is split by heads: each rank holds its KV heads of every layer (or one shared head)
        program = decoder(sharded, batch=3, max_len=14)
        plan = program.autotp_plan
        caches = [n for n in plan.params if len(plan.shapes[n]) == 4 and plan.shapes[n][2] == 14]
        assert len(caches) == 2 * 2 and all(plan.params[n].startswith("S(1") for n in caches), plan.params
        kv_heads = getattr(model.config, "num_key_value_heads", model.config.num_attention_heads)
        for name in caches:
            owner, _, attr = name.rpartition(".")
            assert getattr(program.get_submodule(owner), attr).shape[1] == max(1, kv_heads // world)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_greedy_is_token_exact_with_transformers(world):
    run_ranks(world, _greedy, captures=_greedy_captures)


def _greedy_captures() -> list:
    return [(model, (padded_prompts(128)[0],)) for model in _greedy_models()]


def _flex(rank: int, world: int) -> None:
    """A model configured with ``attn_implementation="flex_attention"``: its forward program attends with
    FlexAttention, its decode program with SDPA (serving/generation.py says why), and the
    tokens are transformers' own, left padding included."""
    model = llama_with(heads=8, kv=2, vocab=128, layers=2)
    model.set_attn_implementation("flex_attention")
    ids, mask = padded_prompts(128)
    sharded = autotp.parallelize(model, (ids,))
    assert any("flex_attention" in str(entry.get("op")) for entry in sharded.autotp_plan.nodes.values())
    with pytest.warns(UserWarning, match="decode program attends with SDPA"):
        got = autotp.generate(sharded, ids, mask, max_new_tokens=8, pad_token_id=0)
    assert model.config._attn_implementation == "flex_attention"  # put back after the decode capture
    want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want), (got, want)


@pytest.mark.slow  # the default tier generates token-exact with SDPA above; flex attention is exact in test_flex.py
def test_a_flex_attention_model_generates_token_exact():
    run_ranks(2, _flex)


def _sampling_model():
    return llama_with(heads=4, kv=2, vocab=128, layers=1)


def _sampling(rank: int, world: int) -> None:
    model = _sampling_model()
    ids, mask = padded_prompts(128)
    sharded = autotp.parallelize(model, (ids,))
    options = {"max_new_tokens": 12, "do_sample": True, "temperature": 0.8, "top_k": 50, "top_p": 0.9}
    first = autotp.generate(sharded, ids, mask, seed=7, **options)
    again = autotp.generate(sharded, ids, mask, seed=7, **options)
    other = autotp.generate(sharded, ids, mask, seed=8, **options)
    assert torch.equal(first, again)  # reproducible for a seed
    assert not torch.equal(first, other)
    everyone = [None] * world
    dist.all_gather_object(everyone, first)
    assert all(torch.equal(t, first) for t in everyone)  # the same tokens on every rank
    with pytest.raises(ValueError, match="temperature"):
        autotp.generate(sharded, ids, mask, do_sample=True, temperature=0)
    _bounded_cache(sharded, ids, mask)


def _bounded_cache(sharded, ids, mask) -> None:
    """At most ``keep_programs`` decode programs (and KV caches) stay alive; freeing drops them all."""
    programs = sharded.__dict__["_autotp_decoders"]
    first = weakref.ref(programs[(3, 18)])
    short = autotp.generate(sharded, ids[:1], mask[:1], max_new_tokens=2, keep_programs=1)
    assert list(programs) == [(1, 8)]
    gc.collect()
    assert first() is None  # the evicted program and its cache are gone, not only unlisted
    assert torch.equal(
        short,
        sharded.autotp_source.generate(
            ids[:1], attention_mask=mask[:1], max_new_tokens=2, do_sample=False, pad_token_id=0
        ),
    )
    second = weakref.ref(programs[(1, 8)])
    autotp.free_generation_cache(sharded)
    gc.collect()
    assert second() is None and "_autotp_decoders" not in sharded.__dict__
    with pytest.raises(ValueError, match="keep_programs"):
        autotp.generate(sharded, ids, mask, keep_programs=0)


def test_sampling_is_shared_and_reproducible():
    run_ranks(2, _sampling, captures=_sampling_captures)


def _sampling_captures() -> list:
    return [(_sampling_model(), (padded_prompts(128)[0],))]


def _compiled(rank: int, world: int, backend: str) -> None:
    """24 tokens from static buffers: the prompt's graph and the one-token step's, whatever the step; the tokens
    are the eager program's (greedy, and sampled for a seed)."""
    from autotp.serving.decode_graphs import CompileOptions

    model = _sampling_model()
    ids, mask = padded_prompts(128)
    sharded = autotp.parallelize(model, (ids,))
    options = CompileOptions(backend=backend)
    for sampled in ({}, {"do_sample": True, "temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 3}):
        eager = autotp.generate(sharded, ids, mask, max_new_tokens=24, eos_token_id=[], pad_token_id=0, **sampled)
        for _ in range(2):  # the second call replays the prompt's graph too
            got = autotp.generate(
                sharded, ids, mask, max_new_tokens=24, eos_token_id=[], pad_token_id=0, compile=options, **sampled
            )
            assert torch.equal(got, eager), (got, eager)
    graphs = sharded.__dict__["_autotp_decoders"][(3, 6 + 24)].autotp_step_graphs[options]
    assert graphs.compiled == 2, graphs.compiled


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_generation_is_two_graphs_for_24_tokens_and_equals_eager(backend):
    run_ranks(2, _compiled, backend, captures=_sampling_captures)
