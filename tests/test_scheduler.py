"""The scheduler alone decides which KV blocks hold which tokens, so a slip there corrupts or stalls requests silently:
these drive it as serving/engine.py does, with a fake model that reads each run's context back through the block table.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotp.serving.scheduler import Refused, Scheduler, Sequence


def next_token(context: list) -> int:
    """The fake model: a deterministic function of every token so far."""
    value = len(context)
    for token in context:
        value = (value * 31 + token + 7) % 1009
    return value


def reference(prompt: list, max_tokens: int) -> list:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class Engine:
    """engine.py's step loop without tensors: a list of slots stands in for the KV cache, each slot holding
    (sequence number, position, token) as written there, and each run reads its whole context back from it."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.cache: list = [None] * (scheduler.total * scheduler.block_size)
        self.sequences: list = []
        self.steps = 0
        self.preempted: list = []  # (sequence, its tokens when preempted)
        self.recomputed: list = []  # (sequence, tokens recomputed before it sampled again)
        self.recompute: dict = {}  # id(sequence) -> [tokens to recompute, tokens recomputed so far]

    def add(self, prompt: list, max_tokens: int, sequence: Sequence | None = None) -> Sequence:
        sequence = sequence or Sequence(list(prompt), max_tokens)
        self.scheduler.add(sequence)
        self.sequences.append(sequence)
        return sequence

    def slot(self, sequence: Sequence, position: int) -> int:
        size = self.scheduler.block_size
        return sequence.blocks[position // size] * size + position % size

    def step(self) -> list:
        s = self.scheduler
        before, waiting = list(s.running), list(s.waiting)
        cached = {id(q): q.cached for q in before}
        preemptions = s.preemptions
        runs = s.schedule()
        self.check(runs, before, waiting, cached, preemptions)
        for run in runs:  # the forward: write the run's keys and values, then attend over its context
            q = run.sequence
            for p in range(run.start, run.start + run.count):
                self.cache[self.slot(q, p)] = (q.number, p, q.tokens[p])
        picks = []
        for run in runs:
            q, end = run.sequence, run.start + run.count
            context = [self.cache[self.slot(q, p)] for p in range(end)]
            assert context == [(q.number, p, t) for p, t in enumerate(q.tokens[:end])], "a context slot is stale"
            if run.samples:
                picks.append((q, next_token([t for _, _, t in context])))
        s.advance(runs)
        for q, token in picks:
            q.output.append(token)
            if len(q.output) >= q.max_tokens:
                s.drop(q)
        self.steps += 1
        return runs

    def check(self, runs: list, before: list, waiting: list, cached: dict, preemptions: int) -> None:
        s = self.scheduler
        assert sum(r.count for r in runs) <= s.budget
        assert len(s.running) <= s.max_num_seqs
        assert len({id(r.sequence) for r in runs}) == len(runs), "a sequence in two runs of one step"
        owned = [b for q in self.sequences for b in q.blocks]
        assert len(owned) == len(set(owned)), "a block owned twice"
        assert sorted(owned + s.free) == list(range(s.total)), "blocks leaked or duplicated"
        assert all(not q.blocks and q.cached == 0 for q in s.waiting)
        assert all(not q.blocks and q not in s.running and q not in s.waiting for q in self.sequences if q.finished)
        ran = {id(r.sequence): r for r in runs}
        preempted = [q for q in before if q in s.waiting or (id(q) in ran and ran[id(q)].start == 0)]
        assert len(preempted) == s.preemptions - preemptions
        rest = [q for q in s.waiting if all(q is not x for x in preempted)]
        assert list(s.waiting)[len(s.waiting) - len(rest) :] == rest, "a preempted sequence is not at the queue's head"
        assert rest == waiting[len(waiting) - len(rest) :], "the queue was not admitted in order"
        for q in preempted:
            self.preempted.append((q, len(q.tokens)))
            self.recompute[id(q)] = [len(q.tokens), 0]
        for q in before:  # every decode runs, unless preempted
            if cached[id(q)] == len(q.tokens) - 1:
                assert id(q) in ran or q in s.waiting, "a running decode was skipped"
        for r in runs:
            q = r.sequence
            assert any(q is x for x in s.running), "a run of a sequence that is not running"
            assert r.count >= 1 and r.start == q.cached and r.start + r.count <= len(q.tokens)
            assert len(q.blocks) * s.block_size >= r.start + r.count, "the run's blocks do not cover it"
            if id(q) in self.recompute:
                need = self.recompute[id(q)]
                assert r.start == need[1], "a recompute skipped or repeated tokens"
                need[1] += r.count
                if r.samples:
                    assert need[1] == need[0] == len(q.tokens), "it sampled before recomputing all it had"
                    self.recomputed.append((q, need[0]))
                    del self.recompute[id(q)]

    def serve(self, arrivals: list, created: list | None = None) -> None:
        """Run until every sequence is done; ``arrivals`` is [(step, prompt, max_tokens)], and ``created`` the order
        their Sequences are made in (engine.py makes them on the server's threads, so not always in arrival order)."""
        s = self.scheduler
        sequences = [None] * len(arrivals)
        for i in created or range(len(arrivals)):
            sequences[i] = Sequence(list(arrivals[i][1]), arrivals[i][2])
        pending = sorted(zip(arrivals, sequences, strict=True), key=lambda a: a[0][0])
        limit = 50 + 20 * sum(len(p) + m for _, p, m in arrivals) + max((a[0] for a in arrivals), default=0)
        while pending or s.running or s.waiting:
            while pending and pending[0][0][0] <= self.steps:
                (_, prompt, max_tokens), sequence = pending.pop(0)
                self.add(prompt, max_tokens, sequence)
            runs = self.step()
            assert runs or not (s.running or s.waiting), "stalled with work to do"
            assert self.steps < limit, "no progress"


def assert_all_done(engine: Engine) -> None:
    for q in engine.sequences:
        assert q.finished and len(q.output) == q.max_tokens
        assert q.output == reference(q.prompt, q.max_tokens)
    assert engine.scheduler.blocks_in_use == 0 and not engine.recompute


@st.composite
def workloads(draw):
    block_size = draw(st.integers(1, 4))
    blocks = draw(st.integers(2, 12))
    config = {
        "max_num_seqs": draw(st.integers(1, 5)),
        "max_batched_tokens": draw(st.integers(1, 16)),
        "max_model_len": draw(st.integers(2, 64)),
    }
    longest = min(config["max_model_len"], blocks * block_size)
    arrivals = []
    for _ in range(draw(st.integers(1, 8))):
        total = draw(st.integers(2, longest))
        length = draw(st.integers(1, total - 1))
        prompt = draw(st.lists(st.integers(0, 50), min_size=length, max_size=length))
        arrivals.append((draw(st.integers(0, 12)), prompt, total - length))
    return (blocks, block_size, config), arrivals, draw(st.permutations(range(len(arrivals))))


@settings(max_examples=60, deadline=None)
@given(workloads())
def test_random_workloads_finish(workload):
    (blocks, block_size, config), arrivals, created = workload
    engine = Engine(Scheduler(blocks, block_size, **config))
    engine.serve(arrivals, created)
    assert len(engine.sequences) == len(arrivals)
    assert_all_done(engine)


def test_preempted_sequence_is_recomputed():
    engine = Engine(Scheduler(4, 2, max_num_seqs=4, max_batched_tokens=16, max_model_len=64))
    engine.serve([(0, [1, 2, 3], 5), (0, [4, 5, 6], 5), (0, [7, 8, 9], 5)])
    assert engine.scheduler.preemptions > 0
    assert any(tokens > len(q.prompt) for q, tokens in engine.preempted), "no preempted sequence had output yet"
    assert any(tokens > len(q.prompt) for q, tokens in engine.recomputed)
    assert_all_done(engine)


def test_decodes_flow_while_long_prompt_chunks():
    s = Scheduler(64, 4, max_num_seqs=8, max_batched_tokens=8, max_model_len=256)
    engine = Engine(s)
    short = [engine.add([i, i + 1], 30) for i in range(3)]
    engine.step()
    assert [len(q.output) for q in short] == [1, 1, 1]
    long = engine.add(list(range(40)), 2)
    chunks = []
    while not long.output:
        outputs = [len(q.output) for q in short]
        runs = engine.step()
        assert [len(q.output) for q in short] == [n + 1 for n in outputs], "a decode waited for the long prompt"
        chunks += [r.count for r in runs if r.sequence is long]
    assert sum(chunks) == 40 and len(chunks) >= 5 and max(chunks) <= 8 - len(short)
    assert s.preemptions == 0


def test_refuses_beyond_max_model_len():
    pool = Scheduler(4, 4, max_model_len=100)  # the pool holds 16 tokens
    with pytest.raises(Refused, match=r"17 tokens.*at most 16"):
        pool.check(Sequence([1] * 10, 7))
    pool.check(Sequence([1] * 10, 6))
    model = Scheduler(100, 4, max_model_len=12)
    with pytest.raises(Refused, match=r"13 tokens.*at most 12"):
        model.add(Sequence([1] * 12, 1))
    assert not model.waiting


def test_refuses_empty_prompt():
    s = Scheduler(4, 4, max_model_len=16)
    with pytest.raises(Refused, match="empty"):
        s.add(Sequence([], 1))
    assert not s.waiting


def test_drop_frees_blocks():
    s = Scheduler(4, 2, max_num_seqs=4, max_batched_tokens=16, max_model_len=8)
    engine = Engine(s)
    a, b, c = (engine.add([i] * 3, 4) for i in range(3))
    engine.step()
    assert [q in s.running for q in (a, b)] == [True, True] and c in s.waiting and s.blocks_in_use == 4
    s.drop(c)  # waiting
    assert c.finished and c not in s.waiting and not c.blocks
    s.drop(a)  # running
    assert a.finished and a not in s.running and not a.blocks and s.blocks_in_use == 2
    while s.running:
        assert all(r.sequence is b for r in engine.step())
    assert b.output == reference(b.prompt, 4) and s.blocks_in_use == 0 and sorted(s.free) == [0, 1, 2, 3]
