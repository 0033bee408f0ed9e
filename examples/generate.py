"""Generate from a sharded model with a KV cache split by heads.

    python examples/generate.py                       # spawns 2 gloo ranks on this machine
    torchrun --nproc-per-node 2 examples/generate.py  # or under torchrun (NCCL on GPUs)

A LLaMA-style model (8 query heads sharing 2 KV heads) is sharded over the ranks; each rank keeps
only its KV heads of the cache.  A padded batch is generated greedily (token-exact with one
process) and by sampling (the same tokens on every rank, reproducible for a seed).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import autotp


def build():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval()


def run(rank: int, world: int) -> None:
    model = build()
    prompts = torch.randint(3, 512, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0  # the second prompt is shorter: left padding
    prompts = prompts.masked_fill(mask == 0, 0)
    sharded = autotp.parallelize(model, (prompts,))
    greedy = autotp.generate(sharded, prompts, mask, max_new_tokens=12, pad_token_id=0)
    sampled = autotp.generate(
        sharded, prompts, mask, max_new_tokens=12, do_sample=True, temperature=0.8, top_p=0.9, seed=42, pad_token_id=0
    )
    if rank == 0:
        reference = model.generate(prompts, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        print(f"greedy, {world} ranks:\n{greedy}\nsame as one process: {torch.equal(greedy, reference)}")
        print(f"sampled (seed 42):\n{sampled}")


if __name__ == "__main__":
    if "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        run(dist.get_rank(), dist.get_world_size())
        dist.destroy_process_group()
    else:
        from autotp.tools.spawn import run_local

        run_local(2, run)
