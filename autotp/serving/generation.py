"""Token generation with a KV cache sharded like the attention heads.

The decode program is a second capture of the same model, wrapped around a static KV cache whose
buffers are written in place (``index_copy_``); autotp plans it like any graph, so the cache is
split by KV heads (shared by neighbouring ranks where there are fewer KV heads than ranks), and
the weights are the forward program's own shards (same placements, no copy).  One program serves
the prefill (a whole prompt) and every one-token decode step.  Rank 0 picks each token and
broadcasts it, so every rank continues with the same tokens.  With ``compile`` the steps are fed from static
buffers, so the prefill and the one-token step are one graph each (serving/decode_graphs.py).
"""

from __future__ import annotations

import inspect
import warnings
from collections import OrderedDict

import torch
import torch.distributed as dist

from autotp.serving.decode_graphs import CompileOptions, StepGraphs
from autotp.serving.sampling import sample_rows, sampling_tensors


class _CachedLM(torch.nn.Module):
    """model(input_ids, attention_mask, position_ids, cache_position) -> last-position logits, with the
    KV cache as in-place-updated buffers (exportable; Hugging Face's StaticCache)."""

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int, device: torch.device):
        super().__init__()
        from transformers.cache_utils import StaticCache

        config = model.config.get_text_config()
        self.model = model
        self.cache = StaticCache(config=config, max_cache_len=max_len)
        kv_heads, head_dim = kv_heads_and_dim(config)
        # the cache tensors become constants of the captured graph, updated in place by index_copy_
        where = torch.device("meta") if _is_meta(model) else device  # allocated per rank, sharded, when meta
        self.cache.early_initialization(batch, kv_heads, head_dim, dtype_of(model), where)

    def forward(self, input_ids, attention_mask, position_ids, cache_position):
        for layer in self.cache.layers:  # where this call writes: its positions, not a count kept since capture
            layer.cumulative_length.copy_(cache_position[0])
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache_position=cache_position,
            use_cache=True,
            logits_to_keep=1,
            **{cache_keyword(self.model): self.cache},
        ).logits


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword a transformers model takes its KV cache by: ``cache`` since 5.24 (``past_key_values`` is
    deprecated there, removed in 5.40), ``past_key_values`` in a model written before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def dtype_of(model: torch.nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def kv_heads_and_dim(config) -> tuple[int, int]:
    """(KV heads, head dim) of a text config: what a layer's cache holds per token."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return heads, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class ResidentShards:
    """The forward program's local shards, served like a checkpoint (``checkpoint=`` of parallelize), and
    ``zeros``: tensors of the new program that no checkpoint holds (a KV pool; name -> full shape), each rank's
    piece allocated zeroed."""

    def __init__(self, sharded: torch.nn.Module, prefix: str, zeros: dict | None = None):
        plan = sharded.autotp_plan
        named = [*sharded.named_parameters(remove_duplicate=False), *sharded.named_buffers(remove_duplicate=False)]
        full = {id(t): tuple(plan.shapes[n]) for n, t in named if n in plan.shapes}  # tied: any alias's
        self.local = {prefix + n: t for n, t in named}
        self.shared = frozenset(self.local)  # handed out themselves: the new program uses the same memory
        self.shapes = {prefix + n: full.get(id(t), tuple(t.shape)) for n, t in named} | dict(zeros or {})
        self.files = dict.fromkeys(self.shapes)
        self.directory = "the sharded model's own shards"

    def shape(self, name: str) -> tuple:
        return self.shapes[name]

    def read_box(self, name: str, box) -> torch.Tensor:
        if name in self.shared:
            return self.local[name]  # this rank's piece itself, whatever the box
        return torch.zeros([len(range(*b.indices(n))) for b, n in zip(box, self.shapes[name], strict=True)])


def decoder(sharded: torch.nn.Module, batch: int, max_len: int) -> torch.nn.Module:
    """The sharded decode program for ``batch`` sequences of up to ``max_len`` tokens (a collective)."""
    from autotp.api import tensor_parallel
    from autotp.options import PlanOptions, RunOptions

    source = sharded.autotp_source
    group = sharded.autotp_group
    device = sharded.autotp_device
    training = source.training
    wrapper = _CachedLM(source, batch, max_len, device).eval()  # never drops; the model's mode is put back
    where = torch.device("meta") if _is_meta(source) else device  # example inputs live with the model
    example = (
        torch.zeros(batch, 2, dtype=torch.long, device=where),  # input_ids
        torch.ones(batch, max_len, dtype=torch.long, device=where),  # attention_mask
        torch.zeros(batch, 2, dtype=torch.long, device=where),  # position_ids
        torch.arange(2, device=where),
    )  # cache_position
    fixed = {f"model.{name}": sharded.autotp_plan.placement(name) for name in sharded.autotp_plan.params}
    attention = _decode_attention(source)
    try:
        return tensor_parallel(
            wrapper,
            example,
            None,
            PlanOptions(topology=sharded.autotp_plan.topology, training=False, fixed=fixed),
            RunOptions(group=group, device=sharded.autotp_device, checkpoint=ResidentShards(sharded, "model.")),
        )
    finally:
        source.train(training)
        if attention is not None:
            source.set_attn_implementation(attention)


def _decode_attention(source: torch.nn.Module) -> str | None:
    """A model configured for FlexAttention is captured for decoding with SDPA (the same attention, read from
    ``config._attn_implementation``; the forward program keeps FlexAttention): transformers' flex mask skips the
    padding mask when every entry is 1 (``if not fast_all(attention_mask)``), a branch on the mask's values that
    torch.export cannot capture.  Returns the implementation to put back, or None."""
    config = source.config.get_text_config()
    if getattr(config, "_attn_implementation", None) != "flex_attention":
        return None
    warnings.warn(
        f"{type(source).__name__} attends with FlexAttention: its decode program attends with SDPA "
        "(transformers' flex mask branches on the mask's values, which torch.export cannot capture)",
        stacklevel=4,
    )
    source.set_attn_implementation("sdpa")
    return "flex_attention"


def _is_meta(model: torch.nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _program(sharded: torch.nn.Module, batch: int, total: int, keep: int) -> torch.nn.Module:
    """The decode program for (batch, total), reused (capture and planning once); the least recently
    used ones are dropped first, so at most ``keep`` KV caches stay allocated.  Every rank calls
    generate in the same order, so every rank keeps and drops the same programs."""
    programs = sharded.__dict__.setdefault("_autotp_decoders", OrderedDict())
    if (batch, total) not in programs:
        while len(programs) >= keep:  # before building: the new cache never coexists with an evicted one
            programs.popitem(last=False)
        programs[(batch, total)] = decoder(sharded, batch, total)
    programs.move_to_end((batch, total))
    return programs[(batch, total)]


def free_generation_cache(sharded: torch.nn.Module) -> None:
    """Drop every decode program and KV cache ``generate`` keeps for ``sharded`` (the next call rebuilds one)."""
    sharded.__dict__.pop("_autotp_decoders", OrderedDict()).clear()


@torch.no_grad()
def generate(
    sharded: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 20,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    keep_programs: int = 4,
    compile: bool | CompileOptions = False,
) -> torch.Tensor:
    """Prompt + generated tokens, [batch, prompt + new], like ``transformers``' ``generate`` (greedy or
    sampled; a finished sequence continues with ``pad_token_id``).  A collective: every rank calls it
    with the same prompt and gets the same tokens.  ``attention_mask`` marks left padding.  The decode
    program (and its KV cache) for each (batch, total length) is built on first use and kept, the
    ``keep_programs`` most recently used of them (``free_generation_cache`` drops them all): stale
    cache entries are never read, as every position is written before it is attended to.  ``compile``: the
    prefill and the one-token steps each run as one compiled graph (and on a GPU group as one replayed CUDA graph;
    serving/decode_graphs.py), the steps fed from static buffers.  A model that is not a Hugging Face one
    (``forward(tokens) -> logits``, its own cache unknown to autotp) runs the sharded forward on the whole sequence
    for every token.  Sampled tokens are keyed by ``seed`` (drawn from torch's generator when None), the row and the
    position (serving/sampling.py)."""
    config = getattr(sharded.autotp_source, "generation_config", None)
    eos = eos_token_id if eos_token_id is not None else getattr(config, "eos_token_id", None)
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    pad = pad_token_id if pad_token_id is not None else getattr(config, "pad_token_id", None)
    pad = pad if pad is not None else (min(eos) if eos else 0)
    if do_sample and temperature <= 0:
        raise ValueError(f"temperature must be positive for sampling, got {temperature}")
    if not isinstance(keep_programs, int) or keep_programs < 1:
        raise ValueError(f"keep_programs must be a positive integer (decode programs kept), got {keep_programs!r}")
    group = sharded.autotp_group
    device = sharded.autotp_device
    batch, prompt = input_ids.shape
    total = prompt + max_new_tokens
    options = CompileOptions() if compile is True else (compile or None)
    last_logits = (
        _cached(sharded, batch, prompt, total, attention_mask, keep_programs, device, options)
        if _cacheable(sharded)
        else _recomputed(sharded, attention_mask)
    )
    seed = int(torch.randint(2**31, ())) if seed is None else seed
    rows = [
        (
            temperature if do_sample else 0.0,
            top_k or 0,
            1.0 if top_p is None else top_p,
            (seed + 0x9E3779B9 * row) & 0xFFFFFFFF,
            0,
        )
        for row in range(batch)
    ]
    temperatures, top_ks, top_ps, seeds, _ = sampling_tensors(rows, device)
    eos_ids = torch.tensor(sorted(eos), device=device, dtype=torch.long)
    tokens = torch.full((batch, total), pad, dtype=torch.long, device=device)
    tokens[:, :prompt] = input_ids
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    end = torch.full((), total, dtype=torch.long, device=device)  # the length once every row is done
    for start in range(prompt, total):
        logits = last_logits(tokens, start)
        chosen = sample_rows(logits, temperatures, top_ks, top_ps, seeds, torch.full_like(seeds, start))
        if dist.get_world_size(group) > 1:  # every rank continues with rank 0's tokens
            dist.broadcast(chosen, group_src=0, group=group)
        tokens[:, start] = torch.where(done, pad, chosen)
        done |= torch.isin(tokens[:, start], eos_ids)
        end = torch.where(done.all() & (end == total), start + 1, end)
        if eos and (start - prompt) % SYNC_EVERY == SYNC_EVERY - 1 and bool(done.all()):  # the host asks now and then
            break
    return tokens[:, : int(end)]


SYNC_EVERY = 8  # steps between the host's looks at whether every row is done


def _cacheable(sharded: torch.nn.Module) -> bool:
    """A Hugging Face model (its config sizes a StaticCache); other models are run on the whole sequence."""
    return hasattr(getattr(sharded.autotp_source, "config", None), "get_text_config")


def _cached(
    sharded, batch: int, prompt: int, total: int, attention_mask, keep: int, device, options: CompileOptions | None
):
    """Last-position logits from the decode program: the prompt first, then one new token a step, from static
    buffers (the same tensors every step: one graph for the prompt and one for every step when compiled)."""
    program = _program(sharded, batch, total, keep)
    if options is not None:
        graphs = program.__dict__.setdefault("autotp_step_graphs", {})
        if options not in graphs:
            graphs[options] = StepGraphs(program, options, sharded.autotp_group, device)
        run = graphs[options]
    else:
        run = program
    mask = torch.zeros(batch, total, dtype=torch.long, device=device)
    mask[:, :prompt] = attention_mask if attention_mask is not None else 1
    mask[:, prompt:] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    step_ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    step_positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
    at = torch.zeros(1, dtype=torch.long, device=device)

    def last_logits(tokens: torch.Tensor, start: int) -> torch.Tensor:
        if start == prompt:
            return run(tokens[:, :prompt], mask, positions[:, :prompt], torch.arange(prompt, device=device))[:, -1]
        step_ids.copy_(tokens[:, start - 1 : start])
        step_positions.copy_(positions[:, start - 1 : start])
        at.fill_(start - 1)
        return run(step_ids, mask, step_positions, at)[:, -1]

    return last_logits


def _recomputed(sharded, attention_mask):
    """Last-position logits of the sharded forward itself, run on the whole sequence each step (a model
    ``forward(tokens) -> logits`` without a cache autotp knows): as its own greedy loop computes them."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "this model takes no attention mask (it is not a Hugging Face model): generate from "
            "prompts of one length without padding"
        )

    def last_logits(tokens: torch.Tensor, start: int) -> torch.Tensor:
        out = sharded(tokens[:, :start])
        return getattr(out, "logits", out)[:, -1]

    return last_logits
