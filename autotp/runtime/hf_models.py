"""Conveniences for Hugging Face models (found by their config object, never by name)."""

from __future__ import annotations

import contextlib

import torch

from autotp.runtime.hf_checkpoint import CheckpointError


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


def computed_buffers(model: torch.nn.Module, wanted: dict) -> dict:
    """Values of ``model``'s non-persistent buffers ``wanted`` (name -> the meta tensor in its place), full size:
    checkpoints rarely hold them (rotary ``inv_freq``), since ``__init__`` computes them from the config.  They
    are recomputed the same way, by constructing ``type(model)(model.config)`` on the CPU with its parameters on
    the meta device (accelerate's ``init_empty_weights``), and cast to the wanted dtypes."""
    advice = (
        f"{', '.join(sorted(wanted))}: computed at construction, in no checkpoint, and left on the meta "
        f"device. Build {type(model).__name__} with accelerate.init_empty_weights(include_buffers=False) "
        "instead of torch.device('meta'), so that buffers stay real, or set them before parallelize"
    )
    config = getattr(model, "config", None)
    if config is None:
        raise CheckpointError(f"{advice} ({type(model).__name__} has no config to rebuild them from)")
    from accelerate import init_empty_weights

    try:
        with torch.device("cpu"), init_empty_weights(include_buffers=False):
            rebuilt = dict(type(model)(config).named_buffers(remove_duplicate=False))
    except Exception as exc:  # any constructor: say what to do instead
        raise CheckpointError(f"{advice} ({type(model).__name__}(config) failed: {exc})") from exc
    found = {}
    for name, meta in wanted.items():
        value = rebuilt.get(name)
        if value is None or value.is_meta or value.shape != meta.shape:
            raise CheckpointError(
                f"{advice} ({type(model).__name__}(config) gives no {name} of shape {tuple(meta.shape)})"
            )
        found[name] = value.to(meta.dtype)
    return found
