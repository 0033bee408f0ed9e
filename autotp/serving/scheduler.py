"""Continuous batching: which sequences run at each step, over a pool of fixed-size KV blocks.

Every step, each running sequence whose prompt is in the cache decodes one token, and the rest of the step's token
budget prefills prompts in chunks (so a long prompt never stalls the decodes around it).  A sequence owns whole
blocks (its block table); when the pool runs out, the latest-arrived sequence not yet in this step is preempted: its
blocks are freed and it waits at the head of the queue, to be recomputed from its prompt and the tokens it had
produced, never dropped.  Pure bookkeeping, no tensors: rank 0 runs it and sends every rank the step it decided
(serving/engine.py).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field


class Refused(ValueError):
    """A request the server can never run as asked (HTTP 400)."""


@dataclass(eq=False)  # one sequence is itself only (queues test membership)
class Sequence:
    prompt: list
    max_tokens: int
    owner: object = None  # who hears of its tokens (serving/engine.py)
    output: list = field(default_factory=list)
    blocks: list = field(default_factory=list)
    cached: int = 0  # tokens whose keys and values are in its blocks
    number: int = field(default_factory=itertools.count().__next__)
    finished: bool = False

    @property
    def tokens(self) -> list:
        return self.prompt + self.output


@dataclass(frozen=True)
class Run:
    """One row of a step: ``count`` tokens of ``sequence`` from position ``start``; ``samples`` when it ends at the
    sequence's last token (its logits choose the next one)."""

    sequence: Sequence
    start: int
    count: int

    @property
    def samples(self) -> bool:
        return self.start + self.count == len(self.sequence.tokens)


class Scheduler:
    def __init__(
        self, blocks: int, block_size: int, *, max_num_seqs: int = 32, max_batched_tokens: int = 512, max_model_len: int
    ):
        if blocks < 1 or block_size < 1 or max_num_seqs < 1 or max_batched_tokens < 1:
            raise ValueError("blocks, block_size, max_num_seqs and max_batched_tokens must be positive")
        self.block_size, self.total = block_size, blocks
        self.max_num_seqs, self.budget = max_num_seqs, max_batched_tokens
        self.max_model_len = min(max_model_len, blocks * block_size)
        self.free = list(range(blocks - 1, -1, -1))
        self.waiting: deque = deque()
        self.running: list = []
        self.preemptions = 0

    def add(self, sequence: Sequence) -> None:
        self.check(sequence)
        self.waiting.append(sequence)

    def check(self, sequence: Sequence) -> None:
        """Refused when the sequence could never run here."""
        need = len(sequence.prompt) + sequence.max_tokens
        if not sequence.prompt:
            raise Refused("the prompt is empty: send at least one token")
        if need > self.max_model_len:
            raise Refused(
                f"the prompt ({len(sequence.prompt)} tokens) and max_tokens ({sequence.max_tokens}) need "
                f"{need} tokens; this server holds at most {self.max_model_len} a sequence: shorten the "
                "prompt or lower max_tokens"
            )

    def drop(self, sequence: Sequence) -> None:
        """A finished or aborted sequence leaves, its blocks freed."""
        sequence.finished = True
        if sequence in self.running:
            self.running.remove(sequence)
        if sequence in self.waiting:
            self.waiting.remove(sequence)
        self._release(sequence)

    @property
    def blocks_in_use(self) -> int:
        return self.total - len(self.free)

    def schedule(self) -> list[Run]:
        """This step's runs: every running decode, then prompt chunks within the token budget."""
        runs: list[Run] = []
        for sequence in list(self.running):
            if sequence in self.running and sequence.cached == len(sequence.tokens) - 1:
                if self._reserve(sequence, 1, runs):
                    runs.append(Run(sequence, sequence.cached, 1))
        budget = self.budget - len(runs)
        for sequence in [s for s in self.running if s.cached < len(s.tokens) - 1]:  # prompts being prefilled
            if sequence in self.running:  # not preempted by an earlier chunk
                budget -= self._chunk(sequence, budget, runs)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            sequence = self.waiting[0]
            room = (len(sequence.blocks) + len(self.free)) * self.block_size - sequence.cached
            count = min(budget, len(sequence.tokens) - sequence.cached, room)
            if count <= 0:
                break  # it waits for blocks (admission preempts no one); nothing behind it jumps the queue
            need = self._blocks_for(sequence, count)
            sequence.blocks += [self.free.pop() for _ in range(need)]
            self.waiting.popleft()
            self.running.append(sequence)
            runs.append(Run(sequence, sequence.cached, count))
            budget -= count
        return runs

    def advance(self, runs: list[Run]) -> None:
        """The runs ran: their tokens are in the cache."""
        for run in runs:
            run.sequence.cached = run.start + run.count

    def _chunk(self, sequence: Sequence, budget: int, runs: list) -> int:
        count = min(budget, len(sequence.tokens) - sequence.cached)
        if count <= 0 or not self._reserve(sequence, count, runs):
            return 0
        runs.append(Run(sequence, sequence.cached, count))
        return count

    def _blocks_for(self, sequence: Sequence, count: int) -> int:
        return max(0, -(-(sequence.cached + count) // self.block_size) - len(sequence.blocks))

    def _reserve(self, sequence: Sequence, count: int, runs: list) -> bool:
        """Blocks for ``count`` more tokens of ``sequence``, preempting the latest admitted others while short; False
        when it is the one preempted."""
        need = self._blocks_for(sequence, count)
        while need > len(self.free):
            victim = max(
                (s for s in self.running if all(r.sequence is not s for r in runs)),
                key=lambda s: s.number,
                default=None,
            )
            if victim is None or victim is sequence or victim.number < sequence.number:
                victim = sequence
            self._preempt(victim)
            if victim is sequence:
                return False
        sequence.blocks += [self.free.pop() for _ in range(need)]
        return True

    def _preempt(self, sequence: Sequence) -> None:
        self.running.remove(sequence)
        self._release(sequence)
        sequence.cached = 0
        self.waiting.appendleft(sequence)
        self.preemptions += 1

    def _release(self, sequence: Sequence) -> None:
        self.free += reversed(sequence.blocks)
        sequence.blocks = []
