"""Bytes per device: parameters with their training state, activations kept for backward, KV cache."""

from __future__ import annotations

from dataclasses import dataclass, fields

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


@dataclass(frozen=True)
class RankMemory:
    """Bytes one device of a layout holds at its step's peak, by term: the dry run (examples/train.py) prints the
    same terms for a rank, and tests/test_measured_memory.py holds them against MemTracker's categories.

    ``parameters``, ``gradients`` and ``optimizer`` are the rank's own (FSDP's shards, else its TP pieces whole);
    ``gathered_parameters`` and ``gathered_gradients`` are the unsharded copies FSDP holds during the step (the
    blocks being run and prefetched, the root unit, or a pipeline stage's whole TP piece); ``activations`` what
    backward keeps for the micro-batches in flight at the schedule's peak (a decoder's KV cache with them);
    ``dispatch`` one layer's expert all-to-all buffers."""

    parameters: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    gathered_parameters: float = 0.0
    gathered_gradients: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0
    dispatch: float = 0.0

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def terms(self) -> dict[str, float]:
        """term name -> bytes, in the order of the fields."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
