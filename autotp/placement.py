"""How one tensor is laid out over the ranks of one mesh dimension.

Three kinds, as in Megatron and DTensor:
  R      every rank holds the full tensor;
  P      every rank holds a summand, the full tensor is their sum;
  S(d)   every rank holds a contiguous 1/N slice of dim d.
A Shard may carry ``chunks``: the dim is a concatenation of blocks (a fused
[q|k|v] projection), and each block is sliced separately, so rank r holds
[q_r|k_r|v_r].  Placements print and parse as short strings for the plan JSON.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    def __str__(self) -> str:
        return "P"


@dataclass(frozen=True)
class Shard:
    dim: int
    chunks: tuple[int, ...] | None = None  # sizes of the fused blocks along dim

    def __str__(self) -> str:
        if self.chunks is None:
            return f"S({self.dim})"
        return f"S({self.dim}|{','.join(map(str, self.chunks))})"

    def blocks(self, size: int) -> tuple[int, ...]:
        return self.chunks if self.chunks is not None else (size,)


Placement = Replicate | Partial | Shard
R = Replicate()
P = Partial()

_SHARD = re.compile(r"S\((-?\d+)(?:\|([\d,]+))?\)$")


def parse(text: str | list | None):
    """Inverse of ``str`` (lists stand for the outputs of multi-output ops)."""
    if text is None:
        return None
    if isinstance(text, list):
        return tuple(parse(t) for t in text)
    if text == "R":
        return R
    if text == "P":
        return P
    m = _SHARD.match(text)
    if not m:
        raise ValueError(f"not a placement: {text!r} (expected R, P, S(dim) or S(dim|a,b,c))")
    chunks = tuple(int(c) for c in m.group(2).split(",")) if m.group(2) else None
    return Shard(int(m.group(1)), chunks)


def dump(placement):
    if placement is None:
        return None
    if isinstance(placement, tuple):
        return [dump(p) for p in placement]
    return str(placement)


def take_local(full: torch.Tensor, shard: Shard, rank: int, world: int) -> torch.Tensor:
    """This rank's slice of a full tensor (block by block for fused dims)."""
    pieces, start = [], 0
    for block in shard.blocks(full.shape[shard.dim]):
        step = block // world
        pieces.append(full.narrow(shard.dim, start + rank * step, step))
        start += block
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, shard.dim)


def assemble(parts: list[torch.Tensor], shard: Shard) -> torch.Tensor:
    """Inverse of take_local: the full tensor from every rank's slice, in rank order."""
    if shard.chunks is None:
        return torch.cat(parts, shard.dim)
    world = len(parts)
    local_blocks = [b // world for b in shard.chunks]
    split = [p.split(local_blocks, shard.dim) for p in parts]
    return torch.cat([torch.cat([s[k] for s in split], shard.dim) for k in range(len(local_blocks))], shard.dim)
