"""Conveniences for Hugging Face models (found by their config object, never by name)."""
from __future__ import annotations

import contextlib

import torch


def default_inputs(model: torch.nn.Module) -> tuple:
    """Example input_ids from the model's config; other models must pass example inputs."""
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        raise TypeError(
            f"{type(model).__name__} has no Hugging Face config to derive example inputs from: "
            "pass them, e.g. autotp.parallelize(model, (example_input,))"
        )
    generator = torch.Generator().manual_seed(0)
    return (torch.randint(0, vocab, (2, 8), generator=generator),)


@contextlib.contextmanager
def no_kv_cache(model: torch.nn.Module):
    """Capture without a KV cache (the sharded module returns logits, not cache objects)."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "use_cache", False):
        yield
        return
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = True
