"""Bytes per device: parameters with their training state, activations kept for backward, KV cache."""

from __future__ import annotations

# The share of a device's memory a plan may fill: the CUDA context, NCCL's buffers and the caching allocator's
# fragmentation take the rest (Megatron and torchtitan users keep a similar margin).
USABLE_FRACTION = 0.9


def memory_limit(topology, limit: float | None = None) -> float:
    """Bytes per device a plan may use on ``topology``: ``limit`` where given, else USABLE_FRACTION of its memory."""
    return limit if limit is not None else USABLE_FRACTION * topology.memory_bytes


def state_factor(element_size: int, training: bool) -> float:
    """Bytes held per byte of parameter: weights, plus gradients and Adam state when training.

    Mixed precision (2-byte weights): weights 2 + grads 2 + fp32 master, m, v 12 = 16 bytes a
    parameter (ZeRO paper); fp32 weights: 4 + 4 + m, v 8 = 16 bytes as well.
    """
    if not training:
        return 1.0
    optimizer = 12 if element_size < 4 else 8
    return (2 * element_size + optimizer) / element_size


KINDS = ("params", "grads", "optimizer", "buffers", "activations", "kv_cache", "temporaries")
# Kinds held only while one op runs: a device needs their largest, not their sum over the ops (or layers).
PEAK_KINDS = ("temporaries",)


def breakdown(by_kind: dict) -> dict:
    """Per-device bytes by kind, with every kind present and their total."""
    parts = {kind: float(by_kind.get(kind, 0.0)) for kind in KINDS}
    return {**parts, "total": sum(parts.values())}


def smallest_fitting_world(replicated: float, sharded_full: float, limit: float, candidates) -> int | None:
    """The smallest world size at which replicated + sharded/N bytes fit in ``limit``, if any."""
    for n in sorted(candidates):
        if replicated + sharded_full / n <= limit:
            return n
    return None
