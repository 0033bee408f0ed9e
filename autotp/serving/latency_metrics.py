"""Latency histograms for ``/metrics``, in Prometheus' text format: time to first token (a request's arrival to
its first token) and inter-token latency (between a sequence's consecutive tokens), vLLM's two serving latencies.
Observed on the engine's thread, read by the server's: a snapshot of plain numbers, no lock needed for a scrape."""

from __future__ import annotations

import bisect

# seconds: vLLM's buckets for both histograms, from 1 ms to 80 s
BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class Histogram:
    def __init__(self, bounds: tuple = BUCKETS):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def lines(self, metric: str) -> list[str]:
        """The histogram as Prometheus exposes one: cumulative ``_bucket`` counts by upper bound, ``_sum``,
        ``_count``."""
        counts, out, total = list(self.counts), [f"# TYPE {metric} histogram"], 0
        for bound, count in zip((*self.bounds, "+Inf"), counts, strict=True):
            total += count
            out.append(f'{metric}_bucket{{le="{bound}"}} {total}')
        return [*out, f"{metric}_sum {self.sum}", f"{metric}_count {total}"]
