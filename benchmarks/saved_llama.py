"""The benchmarks' model: a LLaMA config saved with save_pretrained (random weights), run on 2 gloo ranks."""

from __future__ import annotations

import tempfile

import torch


def run_on_saved_llama(layers: int, hidden: int, fn, *args, world: int = 2, **config):
    """``fn(rank, world, directory, *args)`` on ``world`` local gloo ranks; rank 0's result."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from autotp.tools.spawn import run_local

    torch.manual_seed(0)
    settings = {
        "vocab_size": 1024,
        "hidden_size": hidden,
        "intermediate_size": hidden * 11 // 4,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 512,
        **config,
    }
    with tempfile.TemporaryDirectory() as directory:
        LlamaForCausalLM(LlamaConfig(**settings)).save_pretrained(directory)
        return run_local(world, fn, directory, *args)[0]
