"""Dropout in the sharded program: masks drawn as Megatron's model-parallel RNG draws them.

Where a dropout's input is whole on every rank (replicated, or a partial sum), every rank draws the whole mask
from its default generator, which every rank of the group holds in the same state (ranks seed alike; autotp
checks it on the first call that drops): the same mask on every rank, so a partial sum stays one.  Where the
input is split, each rank draws its own piece from a stream of its own (Megatron's tensor-parallel stream, seed
+ 2718 + rank), so the pieces together are one mask of independent parts; ranks that hold the same piece (heads
shared by neighbouring ranks) share its stream.  The stream is forked for each op from one number drawn from the
default CPU generator: every rank's default generators stay in step, torch.utils.checkpoint's restore of them
makes a recomputed op draw the same mask again, and ``torch.manual_seed`` decides every mask.  The fork is a
custom op taking that number as a tensor (``stream_keep``), so torch.compile keeps the program one graph; a split
attention's probabilities are masked by SDPA's math kernel with that keep-mask (its fused kernels draw inside).

Reference mode (for tests): every rank draws the whole mask one process draws for the same seed, in the same
memory order, and keeps its own piece, so the program equals one process exactly, at N times the mask memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autotp.placement import Shard, take_local

aten = torch.ops.aten
STREAM_OFFSET = 2718  # Megatron's offset of the tensor-parallel seed
MODES = ("default", "reference")


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    return module.default_generators[device.index if device.index is not None else module.current_device()]


def stream_seed() -> torch.Tensor:
    """One draw of the default CPU generator (the same on every rank; torch.utils.checkpoint's restore draws it
    again): the seed a split op's stream is forked from.  A tensor, so a compiled graph takes it as a value."""
    return torch.randint(0, 2**62, (), dtype=torch.int64)


@torch.library.custom_op("autotp::stream_keep", mutates_args=())
def stream_keep(like: torch.Tensor, p: float, seed: torch.Tensor, key: int) -> torch.Tensor:
    """Dropout's keep-mask for ``like`` (drawn in ``like``'s memory order, as dropout draws it) on this rank's
    stream ``key``: the default generator of ``like``'s device re-seeded with ``seed`` plus the key, and restored
    after.  A custom op, so torch.compile traces it as one opaque call (its seed a graph value) where generator
    forks would break the graph; a boolean, so what the backward keeps is one byte an element."""
    device = like.device
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device], device_type=device.type):
        _default_generator(device).manual_seed(int(seed) + STREAM_OFFSET + key)
        return F.dropout(torch.ones_like(like), p, True) != 0


@stream_keep.register_fake
def _(like, p, seed, key):
    return torch.empty_like(like, dtype=torch.bool)


def on_own_stream(x: torch.Tensor, p: float, key: int) -> torch.Tensor:
    """Dropout of ``x`` with its mask drawn on this rank's stream ``key``."""
    return x * stream_keep(x.detach(), p, stream_seed(), key) * (1 / (1 - p))


def _ones(shape: list, order: tuple, like: torch.Tensor) -> torch.Tensor:
    """Ones of ``shape`` laid out in memory with dims ``order`` outermost first: CPU dropout draws its mask in
    memory order (``empty_like`` keeps its input's strides), so the layout decides which element gets which draw."""
    dense = torch.ones([shape[d] for d in order], dtype=like.dtype, device=like.device)
    return dense.permute([order.index(d) for d in range(len(order))])


class Dropout(torch.nn.Module):
    """One training dropout of the program in this rank's form; it drops only in training mode (``sharded.eval()``
    stops it).  ``layout``: how the input is split (None: whole on every rank); ``size``: the full length of the
    split dim (None: passed at run time, a token dim); ``order``: one process's memory order of the input's dims;
    ``key``: this rank's stream."""

    def __init__(self, p: float, layout: Shard | None, size: int | None, order: tuple, key: int, rank: int, world: int):
        super().__init__()
        self.p, self.layout, self.size, self.order, self.key = p, layout, size, order, key
        self.rank, self.world = rank, world
        self.reference = False

    def forward(self, x: torch.Tensor, size: int | None = None) -> torch.Tensor:
        if not self.training:
            return x
        if self.reference:
            shape = list(x.shape)
            if self.layout is not None:
                shape[self.layout.dim] = size if size is not None else self.size
            noise = F.dropout(_ones(shape, self.order, x), self.p, True)
            return x * (take_local(noise, self.layout, self.rank, self.world) if self.layout is not None else noise)
        if self.layout is None:
            return F.dropout(x, self.p, True)
        return on_own_stream(x, self.p, self.key)

    def extra_repr(self) -> str:
        return f"p={self.p}, split={self.layout}, reference={self.reference}"


def _math(q, k, v, mask, p: float, causal: bool, keep: torch.Tensor, scale, gqa: bool) -> torch.Tensor:
    """SDPA's math kernel with a given keep-mask of the probabilities."""
    if mask is not None and mask.dtype == torch.bool:  # as SDPA hands a boolean mask to its math kernel
        mask = torch.where(mask, 0.0, float("-inf")).to(q.dtype)
    return aten._scaled_dot_product_attention_math(q, k, v, mask, p, causal, keep, scale=scale, enable_gqa=gqa)[0]


class Attention(torch.nn.Module):
    """scaled_dot_product_attention with dropout_p in this rank's form (its heads ``layout`` of ``heads``, or all
    of them): the math kernel with a keep-mask from this rank's stream where split; in reference mode the math
    kernel with this rank's heads of the keep-mask one process draws.  Without dropout in eval mode."""

    def __init__(
        self,
        p: float,
        causal: bool,
        scale,
        gqa: bool,
        heads: int,
        layout: Shard | None,
        key: int,
        rank: int,
        world: int,
    ):
        super().__init__()
        self.p, self.causal, self.scale, self.gqa, self.heads = p, causal, scale, gqa, heads
        self.layout, self.key, self.rank, self.world = layout, key, rank, world
        self.reference = False

    def forward(self, q, k, v, mask=None):
        p = self.p if self.training else 0.0
        if p and self.reference:
            b, _, sq, _ = q.shape
            keep = F.dropout(q.new_ones(b, self.heads, sq, k.shape[-2]), p, True) != 0
            if self.layout is not None:
                keep = take_local(keep, self.layout, self.rank, self.world)
            return _math(q, k, v, mask, p, self.causal, keep, self.scale, self.gqa)
        if p and self.layout is not None:  # the probabilities' keep-mask on this rank's stream, as SDPA's math draws it
            b, heads, sq, _ = q.shape
            keep = stream_keep(q.new_empty(b, heads, sq, k.shape[-2]), p, stream_seed(), self.key)
            return _math(q, k, v, mask, p, self.causal, keep, self.scale, self.gqa)
        return F.scaled_dot_product_attention(q, k, v, mask, p, self.causal, scale=self.scale, enable_gqa=self.gqa)

    def extra_repr(self) -> str:
        return f"dropout_p={self.p}, heads split={self.layout}, reference={self.reference}"


def random_ops(module: torch.nn.Module) -> list:
    """The program's ops that draw masks."""
    return [m for m in module.modules() if isinstance(m, (Dropout, Attention))]


def set_mode(module: torch.nn.Module, mode: str) -> list:
    """Draw the program's masks as ``mode`` says ("default": Megatron's streams; "reference": each rank its
    piece of one process's masks, for tests); returns the ops that draw them."""
    found = random_ops(module)
    for m in found:
        m.reference = mode == "reference"
    return found
