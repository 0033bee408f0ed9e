"""Which output dim of a view/reshape carries a sharded input dim, and the reverse."""

from __future__ import annotations

import math


def view_groups(src: list[int], dst: list[int]) -> list[tuple[list[int], list[int]]]:
    """Pair up runs of dims with equal products: [B,S,H*D] -> [B,S,H,D] gives ([2],[2,3]) for the last.

    Sizes are probe numbers (see Context.probe), so symbolic sizes compare exactly.
    Size-1 dims join the run before them.
    """
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        pi = pj = 1
        while True:
            if pi <= pj and i < len(src):
                gi.append(i)
                pi *= src[i]
                i += 1
            elif j < len(dst):
                gj.append(j)
                pj *= dst[j]
                j += 1
            else:
                break
            if pi == pj and gi and gj:  # a run ends: the size-1 dims after it on either side join it
                while i < len(src) and src[i] == 1:
                    gi.append(i)
                    i += 1
                while j < len(dst) and dst[j] == 1:
                    gj.append(j)
                    j += 1
                break
        groups.append((gi, gj))
    return groups


def map_view_dim(src: list[int], dst: list[int], dim: int, world: int) -> tuple[int, bool] | None:
    """The output dim that a shard of input ``dim`` becomes, and whether the mapping is one-to-one.

    Sharding the outermost dim of a merged or split run keeps each rank's data contiguous;
    any other dim of the run would interleave, so it has no image.
    """
    for gi, gj in view_groups(src, dst):
        if dim in gi:
            lead_in = [d for d in gi if src[d] != 1]
            lead_out = [d for d in gj if dst[d] != 1]
            if not lead_in or not lead_out or lead_in[0] != dim or dst[lead_out[0]] % world:
                return None
            if math.prod(src[d] for d in gi) != math.prod(dst[d] for d in gj):
                return None
            one_to_one = len(lead_in) == 1 and len(lead_out) == 1
            return lead_out[0], one_to_one
    return None


def inverse_view_dim(src: list[int], dst: list[int], out_dim: int) -> int | None:
    """The input dim that maps one-to-one onto ``out_dim`` (for fused-block hints), if any."""
    for gi, gj in view_groups(src, dst):
        lead_in = [d for d in gi if src[d] != 1]
        lead_out = [d for d in gj if dst[d] != 1]
        if lead_out == [out_dim] and len(lead_in) == 1:
            return lead_in[0]
    return None


def split_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(input dim, output dim, rest) for each input dim that the view splits into (output dim, *rest dims):
    [b, s, (H+2)*d] -> [b, s, H+2, d] gives (2, 2, d).  A block-wise layout of the input dim counted in
    units of ``rest`` is the same layout of the output dim."""
    found = []
    for gi, gj in view_groups(src, dst):
        lead_in = [d for d in gi if src[d] != 1]
        lead_out = [d for d in gj if dst[d] != 1]
        if len(lead_in) == 1 and len(lead_out) > 1:
            found.append((lead_in[0], lead_out[0], math.prod(dst[d] for d in lead_out[1:])))
    return found


def merged_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(input dim, output dim, rest) for each run of input dims the view merges into one output dim, the run's
    first dim given (rest: the product of the others; 1 where the run is that dim alone): [b, s, H, d] ->
    [b, s, H*d] gives (2, 2, d).  split_runs' inverse: blocks of the input dim, each times ``rest``, are the same
    blocks of the output dim."""
    found = []
    for gi, gj in view_groups(src, dst):
        lead_in = [d for d in gi if src[d] != 1]
        lead_out = [d for d in gj if dst[d] != 1]
        if lead_in and len(lead_out) == 1:
            found.append((lead_in[0], lead_out[0], math.prod(src[d] for d in lead_in[1:])))
    return found
