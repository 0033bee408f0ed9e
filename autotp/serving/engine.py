"""The serving loop: rank 0 decides each step, every rank runs it, rank 0 picks the tokens.

Rank 0 holds the scheduler (serving/scheduler.py) and the requests; each step it broadcasts the step's tensors (the
rows' tokens, positions, slots and block tables, the decodes padded to a batch bucket: serving/step_inputs.py) to
the tensor-parallel ranks, so every rank runs the same program on the same inputs and no rank can diverge.  These
are the host's messages: they go over a CPU group beside the model's (runtime/devices.host_group; an NCCL group
carries no CPU tensor) and reach the GPU as one copy from pinned memory, without blocking.  While idle it
broadcasts a tick a second, so the other ranks' waits never reach the group's timeout; a stop ends every rank's
loop.  The decode call runs through ``StepGraphs`` when compiled (a graph a bucket, replayed; serving/
decode_graphs.py).  Sampling runs on rank 0 only (its logits are the whole vocabulary on every rank), for the whole
batch on the device (serving/sampling.py), and the step's one device-to-host copy brings back the chosen tokens
(and the log-probabilities asked for): nothing inside a step waits for the device.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch
import torch.distributed as dist

from autotp.runtime.devices import host_group
from autotp.serving.choices import Choice, Request
from autotp.serving.decode_graphs import CompileOptions, StepGraphs
from autotp.serving.latency_metrics import Histogram
from autotp.serving.paged_cache import step_program
from autotp.serving.sampling import sample_rows, sampling_tensors
from autotp.serving.scheduler import Run, Scheduler, Sequence
from autotp.serving.step_inputs import StepLayout, batch_buckets, step_calls

TICK_SECONDS = 1.0
RATE_SECONDS = 10.0  # autotp_tokens_per_second: tokens picked over this many seconds
RECENT_STEPS = 4096  # steps remembered for it (more than RATE_SECONDS holds at any step rate served)
KINDS = ("tick", "stop", "step")
HEADER = 2 + 3 * 2  # a step is at most two calls (step_inputs.step_calls)
GREEDY = (0.0, 0, 1.0, 0, 0)  # the sampling of a row that chooses nothing (padding, a chunk before its end)


class Engine:
    """The step loop over a sharded model (``autotp.parallelize``'s).  Every rank constructs it (a collective: it
    captures and plans the step program); rank 0 then calls ``run`` on a thread of its own, the others
    ``follow``."""

    def __init__(
        self,
        sharded,
        tokenizer,
        *,
        blocks: int,
        block_size: int = 16,
        max_num_seqs: int = 32,
        max_batched_tokens: int = 512,
        max_model_len: int | None = None,
        compile: CompileOptions | None = None,
    ):
        self.group = sharded.autotp_group
        self.control = host_group(self.group)  # the steps' messages: CPU tensors
        self.device = sharded.autotp_device
        self.pinned = self.device.type == "cuda"  # step inputs staged in pinned memory, copied without blocking
        self.program = step_program(sharded, blocks + 1, block_size)  # the last block: where padding is written
        self.block_size, self.tokenizer, self.compile = block_size, tokenizer, compile
        config = sharded.autotp_source.config.get_text_config()
        self.vocab_size = config.vocab_size
        self.limits = (max_num_seqs, max_batched_tokens, max_model_len or getattr(config, "max_position_embeddings", 0))
        self._size(blocks)
        eos = getattr(getattr(sharded.autotp_source, "generation_config", None), "eos_token_id", None)
        eos = eos if eos is not None else getattr(tokenizer, "eos_token_id", None)
        self.eos = {eos} if isinstance(eos, int) else set(eos or ())
        self.inbox: deque = deque()
        self.wake = threading.Condition()
        self.stopping = False
        self.error: str | None = None
        self.requests: list = []
        self.generated = 0
        self.recent: deque = deque(maxlen=RECENT_STEPS)  # (time, tokens picked) of recent steps
        self.figures: dict = {}
        self.latencies = {"time_to_first_token_seconds": Histogram(), "inter_token_latency_seconds": Histogram()}
        self._publish()

    def _size(self, blocks: int) -> None:
        """The scheduler, the steps' layout and the decode graphs over a pool of ``blocks`` blocks (and the scratch
        block, the last)."""
        seqs, tokens, limit = self.limits
        size = self.block_size
        self.scratch = blocks * size
        self.scheduler = Scheduler(
            blocks, size, max_num_seqs=seqs, max_batched_tokens=tokens, max_model_len=limit or blocks * size
        )
        self.layout = StepLayout(size, blocks, -(-self.scheduler.max_model_len // size), batch_buckets(seqs))
        compiled = self.compile is not None
        self.decode = StepGraphs(self.program, self.compile, self.group, self.device) if compiled else self.program

    # ---- the pool sized by running (serving/pool_sizing.py), every rank at once before serving ------------------
    def pools(self) -> dict:
        """name -> this rank's piece of each layer's keys or values pool."""
        return {n: b for n, b in self.program.named_buffers() if n.split(".")[-1].startswith(("keys_", "values_"))}

    def pool_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pools().values())

    def profile(self) -> None:
        """The largest step there is, on every rank (a collective; nothing scheduled): max_batched_tokens prompt
        tokens in rows no longer than a sequence may be, then each bucket's decode twice (its graph made and, on a
        GPU, captured), all written to and read from the scratch block."""
        size, scratch = self.block_size, self.scratch // self.block_size
        rows = -(-self.limits[1] // self.scheduler.max_model_len)
        positions = torch.arange(-(-self.limits[1] // rows), device=self.device).repeat(rows, 1)
        table = torch.full((rows, -(-positions.shape[1] // size)), scratch, device=self.device)
        self._forward([(positions * 0, positions, scratch * size + positions % size, table)])
        for rows in self.layout.buckets:
            zeros = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
            table = torch.full((rows, self.layout.table_width), scratch, device=self.device)
            for _ in range(2):
                self._forward([(zeros, zeros, zeros + scratch * size, table)])

    def resize_pool(self, blocks: int) -> None:
        """Every layer's pool reallocated for ``blocks`` blocks (and the scratch block), zeroed; the scheduler, the
        layout and the graphs made anew (a captured graph reads the old pool).  Before serving: nothing runs."""
        kinds = {name: (pool.shape[1:], pool.dtype, pool.device) for name, pool in self.pools().items()}
        for name, (shape, dtype, device) in kinds.items():
            owner, _, leaf = name.rpartition(".")
            module = self.program.get_submodule(owner)
            module._buffers[leaf] = None  # the old pool freed before the new one is made
            module._buffers[leaf] = torch.zeros((blocks + 1) * self.block_size, *shape, dtype=dtype, device=device)
        self._size(blocks)
        self._publish()

    # ---- called from the server's threads --------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue ``request`` (its prompt checked now: Refused names what is wrong)."""
        if self.error is not None:
            raise RuntimeError(self.error)
        if self.stopping:
            raise RuntimeError("the server is shutting down")
        sequences = [Sequence(request.prompt, request.sampling.max_tokens) for _ in range(request.sampling.n)]
        self.scheduler.check(sequences[0])
        request.choices = [Choice(i, s, request.sampling, self.tokenizer) for i, s in enumerate(sequences)]
        for choice in request.choices:
            choice.sequence.owner = (choice, request)
        with self.wake:
            self.inbox.append(("add", request))
            self.wake.notify()

    def abort(self, request: Request) -> None:
        with self.wake:
            self.inbox.append(("abort", request))
            self.wake.notify()

    def stop(self) -> None:
        """Finish what is running and waiting, then end every rank's loop."""
        with self.wake:
            self.stopping = True
            self.wake.notify()

    def metrics(self) -> dict:
        """The figures /metrics reports, read from the server's thread: the counts the engine's thread published
        after its last change, requests not yet taken from the inbox, and tokens a second over the last
        RATE_SECONDS."""
        now = time.time()
        with self.wake:
            arriving = sum(kind == "add" for kind, _ in self.inbox)
            recent = sum(n for t, n in self.recent if now - t < RATE_SECONDS)
            figures = dict(self.figures)
        figures["requests_waiting"] += arriving
        return {**figures, "generation_tokens": self.generated, "tokens_per_second": recent / RATE_SECONDS}

    def _publish(self) -> None:
        """Counts for ``metrics`` (on the engine's thread, the only one that reads its state): a request runs when
        any of its sequences is in the running batch, and waits otherwise (queued or preempted)."""
        running = sum(any(c.sequence in self.scheduler.running for c in r.choices) for r in self.requests)
        figures = {
            "requests_running": running,
            "requests_waiting": len(self.requests) - running,
            "kv_blocks_used": self.scheduler.blocks_in_use,
            "kv_blocks_total": self.scheduler.total,
            "preemptions": self.scheduler.preemptions,
        }
        with self.wake:
            self.figures = figures

    def histograms(self) -> dict:
        """name -> Histogram: time to first token (per request) and inter-token latency (per sequence)."""
        return dict(self.latencies)

    # ---- the loops -----------------------------------------------------------------------------------------
    def run(self) -> None:
        """Rank 0's loop: until ``stop`` and nothing is left, or a failure (every request then hears of it)."""
        try:
            while True:
                self._take_inbox()
                runs = self.scheduler.schedule()
                if not runs:
                    if self.stopping and not self.requests:
                        break
                    with self.wake:
                        if not self.inbox and not self.stopping:
                            self.wake.wait(TICK_SECONDS)
                    self._send(("tick",))
                    continue
                self._step(runs)
            self._send(("stop",))
        except Exception as exc:  # a rank died or a collective failed: every waiting client is told
            self.error = f"the model's ranks failed: {type(exc).__name__}: {exc}"
            for request in self.requests:
                request.error = self.error
                request.notify(request)
            raise

    def follow(self) -> None:
        """Every other rank's loop: run what rank 0 sends until it says stop."""
        while True:
            message = self._send(None)
            if message[0] == "stop":
                return
            if message[0] == "step":
                self._forward(message[1])

    def _send(self, message):
        """Rank 0's message to every rank, as two broadcasts of int64 tensors (no pickling): a header (kind, then rows,
        tokens and context width of each call) and the calls' inputs, flat."""
        header = torch.zeros(HEADER, dtype=torch.long)
        if message is not None:
            calls = message[1] if message[0] == "step" else []
            header[0], header[1] = KINDS.index(message[0]), len(calls)
            for i, (ids, _, _, context) in enumerate(calls):
                header[2 + 3 * i : 5 + 3 * i] = torch.tensor([*ids.shape, context.shape[1]])
        dist.broadcast(header, group_src=0, group=self.control)
        kind, count = KINDS[int(header[0])], int(header[1])
        if kind != "step":
            return (kind,)
        shapes = [header[2 + 3 * i : 5 + 3 * i].tolist() for i in range(count)]
        sizes = [n for rows, tokens, width in shapes for n in (rows * tokens,) * 3 + (rows * width,)]
        flat = torch.empty(sum(sizes), dtype=torch.long, pin_memory=self.pinned)
        if message is not None:
            torch.cat([t.reshape(-1) for call in message[1] for t in call], out=flat)
        dist.broadcast(flat, group_src=0, group=self.control)
        flat = flat.to(self.device, non_blocking=self.pinned)  # the step's one host-to-device copy
        pieces, calls = iter(flat.split(sizes)), []
        for rows, tokens, width in shapes:
            calls.append(tuple(next(pieces).view(rows, n) for n in (tokens, tokens, tokens, width)))
        return ("step", calls)

    def _take_inbox(self) -> None:
        with self.wake:
            items, self.inbox = list(self.inbox), deque()
        for kind, request in items:
            if kind == "add":
                self.requests.append(request)
                for choice in request.choices:
                    self.scheduler.add(choice.sequence)
            elif request in self.requests:
                self._finish(request)
        if items:
            self._publish()

    def _finish(self, request: Request) -> None:
        for choice in request.choices:
            self.scheduler.drop(choice.sequence)
        self.requests.remove(request)

    def _step(self, runs: list[Run]) -> None:
        calls = step_calls(runs, self.layout)
        _, sent = self._send(("step", [inputs for inputs, _ in calls]))
        rows = [row for _, call_rows in calls for row in call_rows]
        chosen = self._device_step(sent, rows).tolist()  # the step's one device-to-host copy
        self.scheduler.advance(runs)
        changed, picked = {}, 0
        for run, values in zip(rows, chosen, strict=True):
            if run is not None and run.samples:  # read before pick, which appends a token
                choice, request = run.sequence.owner
                token, logprob, best = _unpacked(values)
                choice.pick(token, logprob, best, self.eos)
                self._time(choice, request)
                picked += 1
                changed[id(request)] = request
        self.generated += picked
        with self.wake:
            self.recent.append((time.time(), picked))
        for request in changed.values():
            for choice in request.choices:
                if choice.finish_reason and not choice.sequence.finished:
                    self.scheduler.drop(choice.sequence)
            if request.finished:
                self.requests.remove(request)
        self._publish()
        for request in changed.values():
            request.notify(request)

    def _time(self, choice: Choice, request: Request) -> None:
        now = time.monotonic()
        if choice.last_token_at is not None:
            self.latencies["inter_token_latency_seconds"].observe(now - choice.last_token_at)
        elif choice.index == 0:
            self.latencies["time_to_first_token_seconds"].observe(now - request.arrived)
        choice.last_token_at = now

    def _device_step(self, calls: list, rows: list) -> torch.Tensor:
        """The step on the device: the program's calls, then every row's choice (no host sync)."""
        return self._choose(torch.cat(self._forward(calls)), rows)

    def _choose(self, logits: torch.Tensor, rows: list) -> torch.Tensor:
        """Each row's next token [rows] on the device, or where a row asks for log-probabilities [rows, 2 + 2k]
        (float64): token, its log-probability, the k best tokens and theirs (serving/sampling.py)."""
        choices = [r.sequence.owner[0] if r is not None and r.samples else None for r in rows]
        params = sampling_tensors([c.row() if c is not None else GREEDY for c in choices], self.device)
        tokens = sample_rows(_penalized(logits, choices), *params)
        most = max(
            (c.sampling.logprobs for c in choices if c is not None and c.sampling.logprobs is not None), default=None
        )
        if most is None:
            return tokens
        logprobs = logits.float().log_softmax(-1)
        top = logprobs.topk(most)
        return torch.cat(
            [
                tokens[:, None].double(),
                logprobs.gather(-1, tokens[:, None]).double(),
                top.indices.double(),
                top.values.double(),
            ],
            dim=1,
        )

    @torch.no_grad()
    def _forward(self, calls: list) -> list:
        """Each call's logits: the decode call (one token a row) through the bucket's graph when compiled."""
        return [(self.decode if inputs[0].shape[1] == 1 else self.program)(*inputs) for inputs in calls]


def _penalized(logits: torch.Tensor, choices: list) -> torch.Tensor:
    """``logits`` [rows, vocab] less each row's presence and frequency penalties (Choice.penalties), as the rows'
    sampling reads them; the logits themselves where no row asks for any."""
    taken = [c.penalties(logits.shape[-1], logits.device) if c is not None else None for c in choices]
    if all(t is None for t in taken):
        return logits
    zeros = torch.zeros(logits.shape[-1], device=logits.device)
    return logits.float() - torch.stack([zeros if t is None else t for t in taken])


def _unpacked(values) -> tuple:
    """(token, log-probability or None, [(token, log-probability)] best first) from a row of ``Engine._choose``."""
    if not isinstance(values, list):
        return values, None, []
    k = (len(values) - 2) // 2
    return int(values[0]), values[1], [(int(i), v) for i, v in zip(values[2 : 2 + k], values[2 + k :], strict=True)]
