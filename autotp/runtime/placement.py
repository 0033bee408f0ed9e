"""How one tensor is laid out over the ranks of one mesh dimension.

Three kinds, as in Megatron and DTensor:
  R      every rank holds the full tensor;
  P      every rank holds a summand, the full tensor is their sum;
  S(d)   every rank holds a contiguous 1/N slice of dim d.
A Shard may carry ``chunks``: the dim is a concatenation of blocks (a fused
[q|k|v] projection), and each block is sliced separately, so rank r holds
[q_r|k_r|v_r].  It may also carry ``units``: each block is made of that many
indivisible pieces (attention heads) that are dealt out whole:
  units >= N  uneven shards, the first units % N ranks get one more (10 heads on 4: 3,3,2,2);
  units <  N  (N divisible by units) each unit is held by N/units neighbouring ranks, as vLLM
              replicates KV heads when there are fewer of them than ranks ("grouped").
The gradient of a grouped value is split like a partial sum among the ranks that share a unit.
Placements print and parse as short strings for the plan JSON: S(0), S(0|64,64,64), S(1/10).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    def __str__(self) -> str:
        return "P"


def unit_span(units: int, rank: int, world: int) -> tuple[int, int]:
    """(first unit, number of units) that ``rank`` holds out of ``units``."""
    if units < world:
        return rank * units // world, 1
    base, extra = divmod(units, world)
    return rank * base + min(rank, extra), base + (rank < extra)


@dataclass(frozen=True)
class Shard:
    dim: int
    chunks: tuple[int, ...] | None = None  # sizes of the fused blocks along dim
    units: int | None = None               # indivisible pieces per block; None: N equal slices

    def __str__(self) -> str:
        text = str(self.dim)
        if self.chunks is not None:
            text += "|" + ",".join(map(str, self.chunks))
        if self.units is not None:
            text += f"/{self.units}"
        return f"S({text})"

    def at(self, dim: int) -> Shard:
        """The same layout on another dim (a weight's dim 0 for an output's last dim)."""
        return replace(self, dim=dim)

    def parts(self, world: int) -> int:
        return world if self.units is None else self.units

    def grouped(self, world: int) -> bool:
        return self.units is not None and self.units < world

    def even(self, world: int) -> bool:
        return self.units is None or self.units == world

    def blocks(self, size: int) -> tuple[int, ...]:
        return self.chunks if self.chunks is not None else (size,)

    def ranges(self, size: int, rank: int, world: int) -> list[tuple[int, int]]:
        """(start, length) along ``dim`` of each piece this rank holds, in the full tensor."""
        found, offset = [], 0
        for block in self.blocks(size):
            parts = self.parts(world)
            first, count = unit_span(parts, rank, world)
            unit = block // parts
            found.append((offset + first * unit, count * unit))
            offset += block
        return found

    def local_size(self, size: int, rank: int, world: int) -> int:
        return sum(length for _, length in self.ranges(size, rank, world))

    def owners(self, world: int) -> list[int]:
        """One rank per distinct piece (the first of each group), in order."""
        return sorted({unit_span(self.parts(world), r, world)[0]: r for r in reversed(range(world))}.values())


Placement = Replicate | Partial | Shard
R = Replicate()
P = Partial()

_SHARD = re.compile(r"S\((-?\d+)(?:\|([\d,]+))?(?:/(\d+))?\)$")


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
        raise ValueError(f"not a placement: {text!r} (expected R, P, S(dim), S(dim|a,b,c) or S(dim/units))")
    chunks = tuple(int(c) for c in m.group(2).split(",")) if m.group(2) else None
    return Shard(int(m.group(1)), chunks, int(m.group(3)) if m.group(3) else None)


def dump(placement):
    if placement is None:
        return None
    if isinstance(placement, tuple):
        return [dump(p) for p in placement]
    return str(placement)


def take_local(full: torch.Tensor, shard: Shard, rank: int, world: int) -> torch.Tensor:
    """This rank's slice of a full tensor (block by block for fused dims)."""
    ranges = shard.ranges(full.shape[shard.dim], rank, world)
    pieces = [full.narrow(shard.dim, start, length) for start, length in ranges]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, shard.dim)


def assemble(parts: list[torch.Tensor], shard: Shard, size: int) -> torch.Tensor:
    """Inverse of take_local: the full tensor (``size`` along the dim) from every rank's piece, in rank order."""
    world = len(parts)
    owners = shard.owners(world)
    split = {r: parts[r].split([n for _, n in shard.ranges(size, r, world)], shard.dim) for r in owners}
    blocks = len(shard.blocks(size))
    return torch.cat([split[r][k] for k in range(blocks) for r in owners], shard.dim)
