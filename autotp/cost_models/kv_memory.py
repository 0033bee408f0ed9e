"""An attention's K and V at inference, priced as a serving engine holds them.

The cache holds K and V by KV heads, every layer's at once: the tensors grouped-query attention reads before its
repeat to the query heads (``repeat_interleave`` after canonicalize/repeated_kv.py), at this rank's share.  Where
they are already a buffer of the program (the decode step's static cache, written in place) they are counted
there, not again.  The repeated copy lives only while its attention runs: a temporary, counted at the peak of one
op, not summed over layers (cost_models/memory.py's PEAK_KINDS)."""

from __future__ import annotations

import math

from torch.fx import Node

from autotp.cost_models.pricing import Sizes, local_bytes
from autotp.ops.table import op
from autotp.placement import Shard


def attention_memory(node: Node, strategy, sizes: Sizes, world: int, trainable: dict) -> dict:
    """{"kv_cache": the K and V this attention's cache holds on a device, "temporaries": their repeated copy}."""
    cached = temporary = 0.0
    for arg, placement in zip(node.args[1:3], strategy.inputs[1:3], strict=True):
        read = local_bytes(sizes.nbytes(arg), placement, world)
        source, held = arg, read
        if "repeats_each" in op(arg.target).tags:
            source, held = arg.args[0], _before_repeat(arg, placement, sizes, world, read)
            temporary += read
        cached += 0.0 if _a_buffer(source, trainable) else held
    return {"kv_cache": cached, "temporaries": temporary}


def _before_repeat(repeat: Node, placement, sizes: Sizes, world: int, read: float) -> float:
    """This rank's bytes of the repeat's input: the KV heads its query heads need (at least one)."""
    source = repeat.args[0]
    repeats, dim = repeat.args[1], repeat.args[2] if len(repeat.args) > 2 else repeat.kwargs.get("dim")
    if not isinstance(repeats, int) or dim is None:
        return read * sizes.nbytes(source) / max(sizes.nbytes(repeat), 1)
    dim %= repeat.meta["val"].dim()
    if not isinstance(placement, Shard) or placement.dim != dim:  # whole heads on every rank, or split elsewhere
        return read / repeats
    heads = repeat.meta["val"].shape[dim]
    mine = placement.local_size(heads, 0, world)  # rank 0 holds the most
    return sizes.nbytes(source) * math.ceil(mine / repeats) / (heads // repeats)


def _a_buffer(tensor: Node, trainable: dict) -> bool:
    """Whether ``tensor`` is a buffer's storage seen or written in place (a static cache), followed back through
    views and indexed writes."""
    while tensor.op == "call_function":
        row = op(tensor.target)
        if not tensor.args or not isinstance(tensor.args[0], Node):
            return False
        written = row.family == "indexed" and tensor.meta["val"].shape == tensor.args[0].meta["val"].shape
        if not (row.view or written):
            return False
        tensor = tensor.args[0]
    return tensor.op == "get_attr" and tensor.target not in trainable
