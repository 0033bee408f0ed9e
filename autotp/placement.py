"""How one tensor is laid out over the ranks of one mesh dimension.

Three kinds, as in Megatron and DTensor:
  R      every rank holds the full tensor;
  P      every rank holds a summand, the full tensor is their sum;
  S(d)   every rank holds a contiguous 1/N slice of dim d;
  D(e)   a partial sum whose summands are disjoint (expert parallelism): each rank holds rows that only
         its own experts computed (dealt like S(e) deals the experts) and zeros elsewhere.
  A(e)   routed rows (expert parallelism by all-to-all): each rank holds only the rows routed to its own
         experts, sent to it by every rank of the dispatch group; of a parameter, its whole experts.
A Shard may carry ``chunks``: the dim is a concatenation of blocks (a fused
[q|k|v] projection), and each block is sliced separately, so rank r holds
[q_r|k_r|v_r].  It may also carry ``units``: each block is made of that many
indivisible pieces (attention heads) that are dealt out whole:
  units >= N  uneven shards, the first units % N ranks get one more (10 heads on 4: 3,3,2,2);
  units <  N  (N divisible by units) each unit is held by N/units neighbouring ranks, as vLLM
              replicates KV heads when there are fewer of them than ranks ("grouped").
Fused blocks may have units of their own (Phi-3's [8 query heads | 2 KV | 2 KV]: units 8,2,2).
It may carry ``of``: the units follow a split of ``of`` finer units (query heads), each unit serving
of/units of them, and every rank holds the units its own finer ones need -- grouped-query attention's
KV heads for the query heads a rank computes, whatever the counts (8 query heads, 2 KV heads, 3 ranks:
ranks hold KV heads {0}, {0,1}, {1}).  A unit held by several ranks is "grouped"; the gradient of a
grouped value is split like a partial sum among the ranks that share a unit.
With ``groups`` the dim is that many copies of the blocks, copy i serving finer units i*of/groups up to
(i+1)*of/groups (Falcon's new decoder architecture: per KV group [4 query heads | k | v]); a rank holds in
each copy the units its share of the finer ones needs, possibly none (8 query heads, 2 groups, 4 ranks:
rank 1 holds query heads 2, 3 and group 0's k and v).
Placements print and parse as short strings for the plan JSON: S(0), S(0|64,64,64), S(1/10),
S(2|64,16,16/8,2,2@8), S(1/2@8), S(0|32,8,8/4,1,1@8x2).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch

# The notation above in a few lines, for whoever reads a plan (autotp explain, autotp show).
NOTATION = (
    "R: every rank holds the whole tensor; P: each rank holds a summand (an all-reduce sums them); "
    "S(d): dim d split in N contiguous slices; S(d|a,b,c): dim d is fused blocks of sizes a, b, c, each split; "
    "S(d/u): u whole units (heads) dealt out; @f: the units follow f finer ones (grouped KV heads); "
    "D(e): expert rows, zeros where another rank's experts computed; A<n>(e): whole experts over n ranks, "
    "their rows sent by all-to-all"
)


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    def __str__(self) -> str:
        return "P"


@dataclass(frozen=True)
class Disjoint(Partial):
    """A partial sum in which every element is nonzero on at most one rank: the rows routed to experts that
    this rank holds (``experts``: how the experts are dealt out, a Shard of their dim).  Being a partial sum
    it converts like one (all-reduce), and it is one for free; unlike a partial sum it stays exact through
    ops that map 0 to 0 (silu, products of rows split alike), since only one summand of each element is
    nonzero."""

    experts: Shard

    def __str__(self) -> str:
        return "D" + str(self.experts)[1:]

    def owned(self, count: int, rank: int, world: int) -> tuple[int, int]:
        """(first expert, number of experts) that ``rank`` holds out of ``count``."""
        ((first, n),) = self.experts.ranges(count, rank, world)
        return first, n


@dataclass(frozen=True)
class Routed:
    """Whole experts dealt out over the ranks of a dispatch group (``experts``: a Shard of their dim over
    ``ranks`` ranks: the TP group, or the TP group times a mesh's "ep" dim), and of activations the rows
    routed to them: an owner holds only the rows its experts compute, received by all-to-all, never zeros
    for other experts' rows (runtime/expert_dispatch.py).  Not a layout of the full tensor that collectives along one
    dim could convert: only an expert segment's entry (dispatch) and exit (combine) convert it."""

    experts: Shard
    ranks: int

    def __str__(self) -> str:
        return f"A{self.ranks}" + str(self.experts)[1:]

    def owned(self, count: int, rank: int) -> tuple[int, int]:
        """(first expert, number of experts) that dispatch rank ``rank`` holds out of ``count``."""
        ((first, n),) = self.experts.ranges(count, rank, self.ranks)
        return first, n


def unit_span(units: int, rank: int, world: int, of: int | None = None) -> tuple[int, int]:
    """(first unit, number of units) that ``rank`` holds out of ``units``; with ``of``: the units its
    share of ``of`` finer units needs (``of // units`` finer units per unit)."""
    if of is not None and of != units:
        first, count = unit_span(of, rank, world)
        per = of // units
        return first // per, (first + count - 1) // per - first // per + 1
    if units < world:
        return rank * units // world, 1
    base, extra = divmod(units, world)
    return rank * base + min(rank, extra), base + (rank < extra)


@dataclass(frozen=True)
class Shard:
    dim: int
    chunks: tuple[int, ...] | None = None  # sizes of the fused blocks along dim
    units: int | tuple[int, ...] | None = None  # indivisible pieces per block (or for each block); None: N slices
    of: int | None = None  # units follow the split of this many finer units (see above)
    groups: int | None = None  # the blocks repeat this many times, each copy serving of/groups

    def __str__(self) -> str:
        text = str(self.dim)
        if self.chunks is not None:
            text += "|" + ",".join(map(str, self.chunks))
        if self.units is not None:
            text += "/" + (",".join(map(str, self.units)) if isinstance(self.units, tuple) else str(self.units))
        if self.of is not None:
            text += f"@{self.of}"
        if self.groups is not None:
            text += f"x{self.groups}"
        return f"S({text})"

    def at(self, dim: int) -> Shard:
        """The same layout on another dim (a weight's dim 0 for an output's last dim)."""
        return replace(self, dim=dim)

    def parts(self, world: int, block: int = 0) -> int:
        """How many pieces block ``block`` is dealt out in."""
        if self.units is None:
            return world
        if self.groups is not None:
            block %= len(cast(tuple[int, ...], self.chunks))
        return self.units[block] if isinstance(self.units, tuple) else self.units

    def count(self) -> int:
        """How many blocks the dim is made of (the repeated ones counted each time)."""
        return len(self.chunks or (0,)) * (self.groups or 1)

    def spans(self, rank: int, world: int, blocks: int = 1) -> list[tuple[int, int]]:
        """(first piece, number of pieces) this rank holds of each block."""
        if self.groups is not None:
            return [self._group_span(k, rank, world) for k in range(blocks)]
        return [
            unit_span(self.parts(world, k), rank, world, self.of if self.units is not None else None)
            for k in range(blocks)
        ]

    def _group_span(self, k: int, rank: int, world: int) -> tuple[int, int]:
        """The units of block ``k`` (in copy k // len(chunks)) that this rank's finer units need: none is
        (0, 0) before the rank's finer units and (units, 0) after them, so pieces stay in rank order."""
        of, groups, chunks = cast(int, self.of), cast(int, self.groups), cast(tuple[int, ...], self.chunks)
        units, serves = self.parts(world, k), of // groups
        low = k // len(chunks) * serves
        first, count = unit_span(of, rank, world)
        start, end = max(first, low), min(first + count, low + serves)
        if start >= end:
            return (0, 0) if first + count <= low else (units, 0)
        per = serves // units
        return (start - low) // per, (end - 1 - low) // per - (start - low) // per + 1

    def shared_blocks(self, world: int) -> list[bool]:
        """Per block: some unit of it is held by several ranks (its gradient is split like a partial sum)."""
        spans = [self.spans(r, world, self.count()) for r in range(world)]
        return [
            any(right[k][0] < left[k][0] + left[k][1] for left, right in itertools.pairwise(spans))
            for k in range(self.count())
        ]

    def grouped(self, world: int) -> bool:
        """Some unit is held by several ranks (its gradient is split among them like a partial sum)."""
        return any(self.shared_blocks(world))

    def whole(self, world: int) -> bool:
        """Every rank holds all of it (one unit per block, shared by all): the dim it names does not matter."""
        return (
            self.units is not None
            and self.groups is None
            and all(self.parts(world, k) == 1 for k in range(self.count()))
        )

    def block(self, k: int, size: int, world: int) -> Shard:
        """The layout of block ``k`` (``size`` long) cut out on its own, in its simplest spelling, so that
        it compares equal to the same layout reached another way (see ``simplest``)."""
        units = self.parts(world, k) if self.units is not None else None
        of = None if units in (1, self.of) else self.of  # one unit: every rank holds it, whatever it serves
        return simplest(Shard(self.dim, units=units, of=of), size, world)

    def blocks(self, size: int) -> tuple[int, ...]:
        return self.chunks * (self.groups or 1) if self.chunks is not None else (size,)

    def ranges(self, size: int, rank: int, world: int) -> list[tuple[int, int]]:
        """(start, length) along ``dim`` of each piece this rank holds, in the full tensor."""
        found, offset = [], 0
        blocks = self.blocks(size)
        for k, (block, (first, count)) in enumerate(zip(blocks, self.spans(rank, world, len(blocks)), strict=True)):
            unit = block // self.parts(world, k)
            if self.units is None and block % world:  # a token dim of any length: the first ranks get one more
                (first, count), unit = unit_span(block, rank, world), 1
            found.append((offset + first * unit, count * unit))
            offset += block
        return found

    def claims(self, size: int, rank: int, world: int) -> list[tuple[int, int]]:
        """(offset in this rank's piece, length) of each block's part that no lower rank holds: the
        ranks' claims tile the tensor once (who carries a shared unit when pieces are put together)."""
        found, local = [], 0
        for k, (start, length) in enumerate(self.ranges(size, rank, world)):
            end = start
            if rank > 0:
                before, n = self.ranges(size, rank - 1, world)[k]
                end = max(start, before + n)
            found.append((local + end - start, max(0, start + length - end)))
            local += length
        return found

    def local_size(self, size: int, rank: int, world: int) -> int:
        return sum(length for _, length in self.ranges(size, rank, world))


def dealt(units: int, world: int) -> bool:
    """Whole units can be dealt out on their own: unevenly (more units than ranks), or each to a group
    of neighbouring ranks (a divisor of the world size); not evenly (that is a plain N-way split)."""
    return units > 1 and units % world != 0 and (units > world or world % units == 0)


def simplest(shard: Shard, size: int, world: int) -> Shard:
    """The first spelling of ``shard``'s layout among: N equal slices, whole units on their own, itself.
    Rules offer layouts in this order and keep the first spelling (ops/strategies.py)."""

    def layout(s: Shard) -> list[list[tuple[int, int]]]:
        return [s.ranges(size, r, world) for r in range(world)]

    units = shard.parts(world) if shard.units is not None and shard.chunks is None else None
    plain = [Shard(shard.dim)] if size % world == 0 else []
    plain += [Shard(shard.dim, units=units)] if units is not None and dealt(units, world) else []
    return next((s for s in plain if layout(s) == layout(shard)), shard)


Placement = Replicate | Partial | Shard | Routed
R = Replicate()
P = Partial()

_SHARD = re.compile(r"S\((-?\d+)(?:\|([\d,]+))?(?:/([\d,]+))?(?:@(\d+))?(?:x(\d+))?\)$")


def parse(text: str | list[Any] | None) -> Any:
    """Inverse of ``str`` (lists stand for the outputs of multi-output ops)."""
    if text is None:
        return None
    if isinstance(text, list):
        return tuple(parse(t) for t in text)
    if text == "R":
        return R
    if text == "P":
        return P
    if text.startswith("D("):
        return Disjoint(parse("S" + text[1:]))
    routed = re.match(r"A(\d+)(\(.*\))$", text)
    if routed:
        return Routed(parse("S" + routed.group(2)), int(routed.group(1)))
    m = _SHARD.match(text)
    if not m:
        raise ValueError(
            f"not a placement: {text!r} (expected R, P, S(dim), S(dim|a,b,c), "
            "S(dim/units), S(dim|a,b,c/units,units,units@finer) or S(dim|a,b,c/u,u,u@finerxgroups))"
        )
    chunks = tuple(int(c) for c in m.group(2).split(",")) if m.group(2) else None
    listed = tuple(int(u) for u in m.group(3).split(",")) if m.group(3) else None
    units = listed[0] if listed is not None and len(listed) == 1 else listed
    of, groups = (int(m.group(k)) if m.group(k) else None for k in (4, 5))
    if groups is not None and (chunks is None or units is None or of is None or of % groups):
        raise ValueError(f"not a placement: {text!r} (groups need blocks, units and finer units they divide)")
    return Shard(int(m.group(1)), chunks, units, of, groups)


def dump(placement: Any) -> Any:
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
    claims = [shard.claims(size, r, world) for r in range(world)]
    pieces = [
        parts[r].narrow(shard.dim, *claims[r][k])
        for k in range(len(shard.blocks(size)))
        for r in range(world)
        if claims[r][k][1]
    ]
    return torch.cat(pieces, shard.dim)


def piece_ranges(
    shape: Sequence[int],
    placement: Any,
    rank: int,
    world: int,
    box: Sequence[tuple[int, int]] | None = None,
    rows: Iterable[tuple[int, int]] | None = None,
) -> list[list[tuple[int, int]]]:
    """Per dim, the (start, length) spans of the full tensor (``shape``) that this rank's piece is made of, in
    order: ``rows`` (the dim-0 spans of an expert table's experts dealt to this rank, runtime.expert_dispatch.Dealt),
    ``placement``'s TP split of them, then ``box`` (per dim, the (start, length) an outer split such as FSDP2's
    keeps of the TP piece, in the TP piece's coordinates)."""
    ranges = [[(0, size)] for size in shape]
    if rows is not None:
        ranges[0] = list(rows)
    if isinstance(placement, Shard):
        spans = ranges[placement.dim]
        ranges[placement.dim] = [
            cut for start, n in placement.ranges(sum(n for _, n in spans), rank, world) for cut in _cut(spans, start, n)
        ]
    if box is not None:
        ranges = [_cut(spans, start, length) for spans, (start, length) in zip(ranges, box, strict=True)]
    return ranges


def _cut(spans: list[tuple[int, int]], start: int, length: int) -> list[tuple[int, int]]:
    """The part [start, start + length) of the spans laid end to end."""
    found, offset = [], 0
    for first, size in spans:
        low, high = max(start, offset), min(start + length, offset + size)
        if low < high:
            found.append((first + low - offset, high - low))
        offset += size
    return found or [(spans[0][0], 0)]  # an empty piece (FSDP2's last ranks) keeps its place


def fill_ranges(
    out: torch.Tensor,
    ranges: list[list[tuple[int, int]]],
    read_box: Callable[[list[slice]], torch.Tensor],
    chunk_bytes: int = 16 * 2**20,
) -> torch.Tensor:
    """Write the piece ``piece_ranges`` describes into ``out`` from ``read_box([slice per dim])``, box by box and a
    few rows at a time, so that reading a large piece never holds it twice (nor the pages of a mapped file)."""
    starts = [list(itertools.accumulate((n for _, n in spans), initial=0)) for spans in ranges]
    for picks in itertools.product(*(range(len(spans)) for spans in ranges)):
        source = [ranges[d][k] for d, k in enumerate(picks)]
        target = [starts[d][k] for d, k in enumerate(picks)]
        if not source:  # a 0-dim tensor
            out.copy_(read_box([]))
            continue
        (first, rows), rest = source[0], source[1:]
        step = max(1, chunk_bytes // max(1, math.prod(n for _, n in rest) * out.element_size()))
        inner = [slice(a, a + n) for a, n in rest]
        placed = [slice(o, o + n) for o, (_, n) in zip(target[1:], rest, strict=True)]
        for row in range(0, rows, step):
            n = min(step, rows - row)
            out[(slice(target[0] + row, target[0] + row + n), *placed)].copy_(
                read_box([slice(first + row, first + row + n), *inner])
            )
    return out
