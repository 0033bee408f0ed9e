"""Attention that reads a paged KV pool in place: ``autotp::paged_attention``, one op the planner splits by heads.

A row's keys and values live in the pool's slots that its block table lists (serving/paged_cache.py).  Copying
them out, ``[rows, context, kv heads, dim]`` a layer, is what a paged-attention kernel avoids; this op reads the
table a span of blocks at a time instead (flash-decoding's split over the keys): it gathers one span's slots of
every row (``[rows, span × block_size, kv heads, dim]``, bounded by the span, never by the context), scores the
row's queries against them and folds them into a running maximum, sum and weighted values (the online softmax),
so the result is softmax attention up to the order of its sums.  A key at position p (column ``p // block_size``
of the table) is seen by a query at position q when p <= q, and within the window when one is given.

The loop runs over the table's width, a shape, never over values: no host sync, and torch.compile sees one
opaque call whose fake gives the output's shape (graphs replay it as it is).  A span holds as many blocks as keep
its keys and its scores within ``READ_ELEMENTS`` (one block at least).  On the CPU (2^18 elements) that is one
block of every row for 32 decode rows of 8 KV heads of 64 in blocks of 16, and 32 blocks for one row (measured on
one core, both faster than copying the context out and calling SDPA); larger spans on other devices, fewer
launches for the same reads.  The same exact ops run everywhere, captured into the decode graph on a GPU: there
is no fused paged kernel.
"""

from __future__ import annotations

import torch

READ_ELEMENTS = {"cpu": 2**18}  # the most elements a span's keys or scores hold, by device type
DEVICE_READ_ELEMENTS = 2**24  # on any other device


def read_in_place(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    table: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    span: int = 1,
) -> torch.Tensor:
    """softmax(q kᵀ × scale) v over each row's table: query [rows, heads, tokens, dim] at ``positions`` [rows,
    tokens], pools ``keys``/``values`` [slots, kv heads, dim], ``table`` [rows, n]; -> [rows, heads, tokens, dim].
    Query head h reads KV head h // (heads / kv heads), as transformers' repeat_kv lays them out; sums in float32
    at least."""
    rows, heads, tokens, dim = query.shape
    kv = keys.shape[1]
    group, exact = heads // kv, torch.promote_types(query.dtype, torch.float32)
    q = query.to(exact).reshape(rows, kv, group * tokens, dim) * scale
    here = positions[:, None, :].expand(rows, group, tokens).reshape(rows, 1, group * tokens, 1)
    top = torch.full((rows, kv, group * tokens, 1), -torch.inf, dtype=exact, device=query.device)
    total = torch.zeros_like(top)
    out = torch.zeros(rows, kv, group * tokens, dim, dtype=exact, device=query.device)
    offsets = torch.arange(block_size, device=query.device)
    for first in range(0, table.shape[1], span):
        blocks = table[:, first : first + span]
        slots = (blocks[:, :, None] * block_size + offsets).reshape(-1)
        width = slots.shape[0] // rows
        k = keys.index_select(0, slots).view(rows, width, kv, dim).permute(0, 2, 3, 1).to(exact)
        v = values.index_select(0, slots).view(rows, width, kv, dim).transpose(1, 2).to(exact)
        scores = q @ k  # [rows, kv, group × tokens, width]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        seen = first * block_size + torch.arange(width, device=query.device)
        allowed = seen <= here
        if window:
            allowed = allowed & (here - seen < window)
        scores = scores.masked_fill(~allowed, -torch.inf)
        new = torch.maximum(top, scores.amax(-1, keepdim=True))
        shift = new.masked_fill(new == -torch.inf, 0)  # a query that has seen no key yet adds nothing
        weights = torch.exp(scores - shift)
        fade = torch.exp(top - shift)
        total = total * fade + weights.sum(-1, keepdim=True)
        out = out * fade + weights @ v
        top = new
    return (out / total).reshape(rows, heads, tokens, dim).to(query.dtype)


@torch.library.custom_op("autotp::paged_attention", mutates_args=())
def paged_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    table: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    scale: float,
    window: int,
    softcap: float,
) -> torch.Tensor:
    """``read_in_place`` over spans of ``span_of`` blocks."""
    rows, heads, tokens, dim = query.shape
    span = span_of(query.device.type, rows, block_size, keys.shape[1] * dim, heads * tokens)
    return read_in_place(query, keys, values, table, positions, block_size, scale, window, softcap, span)


def span_of(device_type: str, rows: int, block_size: int, kv_width: int, score_width: int) -> int:
    """Blocks a span reads: as many as keep its keys [rows, span × block_size, kv_width] and its scores
    [rows, score_width, span × block_size] within the device's ``READ_ELEMENTS``, one at least."""
    per_block = rows * block_size * max(kv_width, score_width)
    return max(1, READ_ELEMENTS.get(device_type, DEVICE_READ_ELEMENTS) // per_block)


@paged_attention.register_fake
def _(query, keys, values, table, positions, block_size, scale, window, softcap):
    return torch.empty_like(query)


PAGED_ATTENTION = torch.ops.autotp.paged_attention.default
