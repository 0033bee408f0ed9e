"""Choosing the next token of every row of a batch at once, on the device, without a host sync.

Each row has its own temperature (0: greedy), top-k (0: off), top-p (1: off) and seed, given as tensors, so one
batch mixes requests of any kinds and the whole choice is a fixed set of kernels (capturable, no ``.item()``).
The filters are transformers' (top-k, then top-p over the scores sorted ascending).  A sampled row draws by the
Gumbel-max trick, ``argmax(scores + g)`` with ``g = -log(-log u)``: ``u`` is a counter-based hash of the row's
seed, its counter (the position of the token being chosen) and the vocabulary index, a pure function of integers
(philox-style keyed randomness): no generator state to advance or to capture, the same token for the same seed and
position whatever else runs in the batch, and a sequence recomputed after preemption draws what it drew before.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2**32`` for 32-bit ``x`` held in int64, in two 16-bit halves (no product leaves int64's
    range, so no overflow, whatever the device's integer arithmetic does on one)."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32): every output bit depends on every input bit."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def keyed_gumbel(seeds: torch.Tensor, counters: torch.Tensor, width: int) -> torch.Tensor:
    """Gumbel noise [rows, width] (float32), a pure function of each row's (seed, counter) and the column."""
    row = mix32(mix32(seeds.long()) ^ (counters.long() & MASK32))
    columns = torch.arange(width, device=seeds.device, dtype=torch.long)
    bits = mix32(mix32(row[:, None] ^ columns) + row[:, None])
    uniform = (bits.double() + 0.5) / 2.0**32  # in (0, 1): never 0 or 1
    return (-torch.log(-torch.log(uniform))).float()


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
) -> torch.Tensor:
    """The next token of each row of ``logits`` [rows, vocab] (int64 [rows], on the logits' device).  Per row:
    ``temperature`` (0: the argmax), ``top_k`` (0: every token), ``top_p`` (1: every token), ``seeds`` and
    ``counters`` (the noise's key)."""
    greedy = logits.argmax(dim=-1)
    sampled = temperature > 0
    scores = logits.float() / torch.where(sampled, temperature, 1.0).float()[:, None]
    ascending, order = scores.sort(dim=-1)
    width = scores.shape[-1]
    k = torch.where(top_k > 0, top_k, width).clamp(max=width).long()
    kth = ascending.gather(-1, (width - k)[:, None])  # the k-th largest score: below it is dropped (ties kept)
    ascending = ascending.masked_fill(ascending < kth, float("-inf"))
    drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p.float())[:, None]
    drop[:, -1] = False  # the most likely token always stays
    ascending = ascending.masked_fill(drop, float("-inf"))
    noise = keyed_gumbel(seeds, counters, width).gather(-1, order)  # keyed by vocabulary index, not rank
    picked = order.gather(-1, (ascending + noise).argmax(dim=-1, keepdim=True))[:, 0]
    return torch.where(sampled, picked, greedy)


def sampling_tensors(rows: list[tuple], device: torch.device) -> tuple:
    """(temperature, top_k, top_p, seeds, counters) on ``device`` from one (temperature, top_k, top_p, seed,
    counter) tuple a row: one host-to-device copy (float64 holds every seed and counter below 2**53 exactly)."""
    packed = torch.tensor(rows, dtype=torch.float64).reshape(len(rows), 5)
    if device.type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    else:
        packed = packed.to(device)
    temperature, top_k, top_p, seeds, counters = packed.unbind(-1)
    return temperature.float(), top_k.long(), top_p.float(), seeds.long(), counters.long()
