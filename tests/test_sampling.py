"""Batch sampling on the device (serving/sampling.py): each row's own filters as transformers' warpers apply them,
draws that follow the distribution, keyed by (seed, position) whatever else is in the batch."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from autotp.serving.sampling import sample_rows


def _rows(count: int, temperature: float, top_k: int, top_p: float, seed: int = 1):
    return (
        torch.full((count,), temperature),
        torch.full((count,), top_k),
        torch.full((count,), top_p),
        torch.full((count,), seed),
        torch.arange(count),
    )


def test_draws_follow_the_filtered_distribution():
    """4000 draws of one row (counters 0..3999): every token in transformers' warped support, frequencies within
    0.03 of its probabilities; greedy rows take the argmax."""
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(0)) * 2
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 6, 0.7)):
        scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
        scores = TopKLogitsWarper(top_k)(None, scores) if top_k else scores
        scores = TopPLogitsWarper(top_p)(None, scores) if top_p < 1 else scores
        want = scores.softmax(-1)[0]
        drawn = sample_rows(logits.expand(4000, -1), *_rows(4000, temperature, top_k, top_p))
        seen = torch.bincount(drawn, minlength=12).double() / 4000
        assert set(drawn.tolist()) <= set(torch.nonzero(want > 0)[:, 0].tolist())
        assert (seen - want).abs().max() < 0.03, (temperature, top_k, top_p, seen, want)
    greedy = sample_rows(logits.expand(3, -1), *_rows(3, 0.0, 0, 1.0))
    assert greedy.tolist() == [int(logits.argmax())] * 3


def test_a_rows_draw_depends_on_its_seed_and_position_only():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    temperature, top_k, top_p = torch.ones(6), torch.zeros(6, dtype=torch.long), torch.ones(6)
    seeds, counters = torch.tensor([5, 6, 7, 8, 9, 10]), torch.tensor([3, 3, 3, 4, 4, 4])
    batch = sample_rows(logits, temperature, top_k, top_p, seeds, counters)
    alone = [
        sample_rows(logits[i : i + 1], temperature[:1], top_k[:1], top_p[:1], seeds[i : i + 1], counters[i : i + 1])
        for i in range(6)
    ]
    assert batch.tolist() == torch.cat(alone).tolist()
    other = sample_rows(logits, temperature, top_k, top_p, seeds + 100, counters)
    assert not torch.equal(batch, other)
