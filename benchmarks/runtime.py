"""Forward time of the same LLaMA weights three ways on 2 gloo ranks: autotp, transformers'
tp_plan="auto" (DTensor), and a minimal hand-written Megatron reference (plain tensors + all_reduce).

    python benchmarks/runtime.py [--layers 4] [--hidden 512] [--repeats 7]

Prefill (batch 4 x 128 tokens) and decode-like (batch 1 x 1 token) forwards without a cache, the
three runners alternated, medians reported with time ratios.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from saved_llama import run_on_saved_llama


class Megatron(torch.nn.Module):
    """LLaMA by hand: q/k/v, gate/up column-split, o/down row-split, one all-reduce after each."""

    def __init__(self, model, rank: int, world: int):
        super().__init__()
        c = model.config
        self.rank, self.world, self.eps = rank, world, c.rms_norm_eps
        self.heads, self.kv = c.num_attention_heads // world, c.num_key_value_heads // world
        self.dim = c.hidden_size // c.num_attention_heads
        self.inv_freq = model.model.rotary_emb.inv_freq

        def rows(w):
            return w.detach().chunk(world, 0)[rank].contiguous()

        def cols(w):
            return w.detach().chunk(world, 1)[rank].contiguous()

        self.embed = model.model.embed_tokens.weight.detach()
        self.layers = [{"ln1": layer.input_layernorm.weight.detach(),
                        "ln2": layer.post_attention_layernorm.weight.detach(),
                        "q": rows(layer.self_attn.q_proj.weight), "k": rows(layer.self_attn.k_proj.weight),
                        "v": rows(layer.self_attn.v_proj.weight), "o": cols(layer.self_attn.o_proj.weight),
                        "gate": rows(layer.mlp.gate_proj.weight), "up": rows(layer.mlp.up_proj.weight),
                        "down": cols(layer.mlp.down_proj.weight)} for layer in model.model.layers]
        self.norm, self.head = model.model.norm.weight.detach(), model.lm_head.weight.detach()

    def _rms(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def forward(self, ids):
        b, s = ids.shape
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
            out = F.linear(a, p["o"])
            dist.all_reduce(out)
            x = x + out
            h = self._rms(x, p["ln2"])
            out = F.linear(F.silu(F.linear(h, p["gate"])) * F.linear(h, p["up"]), p["down"])
            dist.all_reduce(out)
            x = x + out
        return F.linear(self._rms(x, self.norm), self.head)


def _rank(rank: int, world: int, directory: str, repeats: int) -> dict:
    import transformers

    import autotp
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    runners = {"autotp": autotp.parallelize(model),
               "hf": transformers.AutoModelForCausalLM.from_pretrained(directory, tp_plan="auto").eval(),
               "reference": Megatron(model, rank, world)}
    shapes = {"prefill 4x128": (4, 128), "decode 1x1": (1, 1)}
    times = {(shape, name): [] for shape in shapes for name in runners}
    with torch.no_grad():
        for shape, (b, s) in shapes.items():
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
                    run(ids)
                    times[(shape, name)].append(time.perf_counter() - start)
    return {key: statistics.median(values) for key, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    medians = run_on_saved_llama(args.layers, args.hidden, _rank, args.repeats, vocab_size=2048, use_cache=False)
    for shape in ("prefill 4x128", "decode 1x1"):
        ours, hf, ref = (medians[(shape, n)] for n in ("autotp", "hf", "reference"))
        print(f"{shape:14s} autotp {ours * 1e3:7.2f} ms  hf {hf * 1e3:7.2f} ms  reference {ref * 1e3:7.2f} ms  "
              f"autotp/hf {ours / hf:.2f}x  autotp/reference {ours / ref:.2f}x")


if __name__ == "__main__":
    main()
