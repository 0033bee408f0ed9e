"""Forward time of the same LLaMA weights on 2 gloo ranks: autotp, transformers' tp_plan="auto"
(DTensor), and a minimal hand-written Megatron reference (plain tensors; vocabulary-parallel embedding
and head as in Megatron-LM, and a variant with both replicated).

    python benchmarks/runtime.py [--layers 4] [--hidden 512] [--repeats 15] [--decode-steps 5]

The reference runs twice: with plain c10d collectives (``dist.all_reduce``, ``dist.all_gather``), and
with the collectives autotp's emitted program calls (``autotp.runtime.collectives``: on gloo a one-shot
all-reduce for small tensors and polled waits).  autotp against the second says what the plan and
the emitted program are worth; against the first, what they and the gloo shortcuts are worth together.

Prefill (batch 4 x 128 tokens) and decode-like (batch 1 x 1 token) forwards without a cache, the
runners alternated, medians reported with time ratios.  A sample is one prefill forward, or
``--decode-steps`` decode-like forwards back to back as generation runs them (a single forward of
a few ms, timed right after a barrier, also measures how unevenly the ranks leave the barrier).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from machine import describe
from saved_llama import run_on_saved_llama

from autotp.runtime import collectives, transport


class Megatron(torch.nn.Module):
    """LLaMA by hand: q/k/v, gate/up column-split, o/down row-split, one all-reduce after each.

    ``vocab_parallel``: as Megatron-LM, the embedding is split by vocabulary (masked lookup, one
    all-reduce) and the head by vocabulary (logits all-gathered); otherwise both are replicated
    (fewer collectives, the full vocabulary's weights on every rank).  ``autotp_collectives``: the
    all-reduces and the gather are autotp's run-time collectives instead of plain c10d calls."""

    def __init__(self, model, rank: int, world: int, vocab_parallel: bool = True, autotp_collectives: bool = False):
        super().__init__()
        c = model.config
        self.rank, self.world, self.eps = rank, world, c.rms_norm_eps
        self.heads, self.kv = c.num_attention_heads // world, c.num_key_value_heads // world
        self.dim = c.hidden_size // c.num_attention_heads
        self.inv_freq = model.model.rotary_emb.inv_freq
        self.vocab = c.vocab_size
        self.group = dist.group.WORLD
        self.autotp_collectives = autotp_collectives
        if autotp_collectives:
            transport.register(self.group)  # gloo: the shortcuts autotp's own program takes

        def rows(w):
            return w.detach().chunk(world, 0)[rank].contiguous()

        def cols(w):
            return w.detach().chunk(world, 1)[rank].contiguous()

        self.vocab_parallel = vocab_parallel
        self.embed = model.model.embed_tokens.weight.detach()
        self.head = model.lm_head.weight.detach()
        if vocab_parallel:
            self.embed, self.head = rows(self.embed), rows(self.head)
        self.layers = [
            {
                "ln1": layer.input_layernorm.weight.detach(),
                "ln2": layer.post_attention_layernorm.weight.detach(),
                "q": rows(layer.self_attn.q_proj.weight),
                "k": rows(layer.self_attn.k_proj.weight),
                "v": rows(layer.self_attn.v_proj.weight),
                "o": cols(layer.self_attn.o_proj.weight),
                "gate": rows(layer.mlp.gate_proj.weight),
                "up": rows(layer.mlp.up_proj.weight),
                "down": cols(layer.mlp.down_proj.weight),
            }
            for layer in model.model.layers
        ]
        self.norm = model.model.norm.weight.detach()

    def _all_reduce(self, x):
        if self.autotp_collectives:
            return collectives.all_reduce(x, self.group.group_name, "reference all-reduce")
        dist.all_reduce(x)
        return x

    def _gather_vocab(self, logits):
        """Every rank's slice of the vocabulary, concatenated along the last dim."""
        if self.autotp_collectives:
            last = logits.dim() - 1
            return collectives.gather(
                logits,
                last,
                None,
                None,
                None,
                None,
                self.vocab,
                self.rank,
                self.world,
                self.group.group_name,
                "reference logits",
            )
        pieces = [torch.empty_like(logits) for _ in range(self.world)]
        dist.all_gather(pieces, logits.contiguous())
        return torch.cat(pieces, -1)

    def _rms(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def forward(self, ids):
        b, s = ids.shape
        if self.vocab_parallel:
            start = self.rank * self.embed.shape[0]
            local = ids - start
            outside = (local < 0) | (local >= self.embed.shape[0])
            x = F.embedding(local.masked_fill(outside, 0), self.embed).masked_fill(outside[..., None], 0.0)
            x = self._all_reduce(x)
        else:
            x = F.embedding(ids, self.embed)
        angles = torch.arange(s, dtype=torch.float32)[:, None] * self.inv_freq[None]
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

        def rope(t):
            half = t.shape[-1] // 2
            return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

        for p in self.layers:
            h = self._rms(x, p["ln1"])
            q = rope(F.linear(h, p["q"]).view(b, s, self.heads, self.dim).transpose(1, 2))
            k = rope(F.linear(h, p["k"]).view(b, s, self.kv, self.dim).transpose(1, 2))
            v = F.linear(h, p["v"]).view(b, s, self.kv, self.dim).transpose(1, 2)
            k, v = (t.repeat_interleave(self.heads // self.kv, 1) for t in (k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=s > 1).transpose(1, 2).reshape(b, s, -1)
            x = x + self._all_reduce(F.linear(a, p["o"]))
            h = self._rms(x, p["ln2"])
            x = x + self._all_reduce(F.linear(F.silu(F.linear(h, p["gate"])) * F.linear(h, p["up"]), p["down"]))
        logits = F.linear(self._rms(x, self.norm), self.head)
        return self._gather_vocab(logits) if self.vocab_parallel else logits


def _rank(rank: int, world: int, directory: str, repeats: int, decode_steps: int) -> dict:
    import transformers

    import autotp

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    runners = {
        "autotp": autotp.parallelize(model),
        "hf": transformers.AutoModelForCausalLM.from_pretrained(directory, tp_plan="auto").eval(),
        "reference, c10d collectives": Megatron(model, rank, world),
        "reference, autotp collectives": Megatron(model, rank, world, autotp_collectives=True),
        "reference, replicated vocab, autotp collectives": Megatron(
            model, rank, world, vocab_parallel=False, autotp_collectives=True
        ),
    }
    shapes = {"prefill 4x128": (4, 128, 1), "decode 1x1": (1, 1, decode_steps)}  # batch, sequence, steps
    times = {(shape, name): [] for shape in shapes for name in runners}
    with torch.no_grad():
        for shape, (b, s, steps) in shapes.items():
            ids = torch.randint(0, model.config.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
            want = model(ids).logits
            for name, run in runners.items():  # warm up, and check every runner computes the same logits
                got = run(ids)
                got = getattr(got, "logits", got)
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (name, (got - want).abs().max())
            for _ in range(repeats):
                for name, run in runners.items():
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(steps):
                        run(ids)
                    times[(shape, name)].append((time.perf_counter() - start) / steps)
    return {key: statistics.median(values) for key, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--decode-steps", type=int, default=5)
    args = parser.parse_args()
    medians = run_on_saved_llama(
        args.layers, args.hidden, _rank, args.repeats, args.decode_steps, vocab_size=2048, use_cache=False
    )
    print(f"{describe('gloo')}; 2 ranks, {args.layers} layers, hidden {args.hidden}, medians of {args.repeats}")
    for shape in ("prefill 4x128", "decode 1x1"):
        ours = medians[(shape, "autotp")]
        print(f"{shape}: autotp {ours * 1e3:.2f} ms; each other runner, and autotp's time over its time:")
        for (where, name), seconds in medians.items():
            if where == shape and name != "autotp":
                print(f"  {name:48s} {seconds * 1e3:7.2f} ms   autotp/this {ours / seconds:.2f}x")


if __name__ == "__main__":
    main()
