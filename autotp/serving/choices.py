"""What a request asks of its tokens and what the client sees of them: Sampling (OpenAI's fields), each of its
n sequences as a Choice (its text in whole characters, stop strings, penalties, log-probabilities) and the
Request that holds them.  The engine (serving/engine.py) steps them."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from autotp.serving.detokenize import IncrementalText
from autotp.serving.scheduler import Refused, Sequence


@dataclass(frozen=True)
class Sampling:
    """What a request asks of its tokens (OpenAI's fields; ``top_k`` is vLLM's extension). temperature 0: greedy.
    The penalties lower a token's logit by ``presence_penalty`` once it was generated and by ``frequency_penalty``
    for each time it was (OpenAI's and vLLM's definition: over the generated tokens, not the prompt)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple = ()
    n: int = 1
    logprobs: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be a positive integer"),
            (self.temperature >= 0, "temperature must be at least 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be 0 (off) or a positive integer"),
            (isinstance(self.n, int) and 1 <= self.n <= 16, "n must be an integer from 1 to 16"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be from 0 to 20"),
            (
                all(isinstance(s, str) and s for s in self.stop) and len(self.stop) <= 4,
                "stop must be up to 4 non-empty strings",
            ),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be from -2 to 2"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be from -2 to 2"),
        ]
        for ok, message in checks:
            if not ok:
                raise Refused(message)


class Choice:
    """One of a request's ``n`` sequences as the client sees it: text so far (whole characters, ended before a stop
    string), and what is sent of it."""

    def __init__(self, index: int, sequence: Sequence, sampling: Sampling, tokenizer):
        self.index, self.sequence, self.sampling = index, sequence, sampling
        self.detokenized = IncrementalText(tokenizer)
        self.text, self.sent, self.finish_reason, self.logprobs = "", 0, None, []
        self.counts: torch.Tensor | None = None  # times each token was generated (on the device), for the penalties
        self.last_token_at: float | None = None  # when its latest token came (time.monotonic)
        seed = sampling.seed if sampling.seed is not None else int(torch.randint(2**31, ()))
        self.seed = (seed + 0x9E3779B9 * index) & 0xFFFFFFFF  # serving/sampling.py keys its draws by it

    def row(self) -> tuple:
        """How this choice's next token is drawn (serving/sampling.py): keyed by its seed and position."""
        s = self.sampling
        return s.temperature, s.top_k, s.top_p, self.seed, len(self.sequence.tokens)

    def penalties(self, vocab: int, device: torch.device) -> torch.Tensor | None:
        """What the presence and frequency penalties take off each logit [vocab] (on the device, no host sync), or
        None when the request asks for none."""
        s = self.sampling
        if not (s.presence_penalty or s.frequency_penalty):
            return None
        if self.counts is None:  # the tokens generated so far, counted once; pick adds each new one
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            generated = torch.tensor(self.sequence.output, dtype=torch.long).to(device)
            self.counts.index_add_(0, generated, torch.ones(len(self.sequence.output), device=device))
        return s.presence_penalty * (self.counts > 0) + s.frequency_penalty * self.counts

    def pick(self, token: int, logprob: float | None, best: list, eos: set) -> None:
        """Take the token chosen on the device (its log-probability and the best others', when asked: the model's
        own, before the penalties, as vLLM reports them); finish on end of sequence, a stop string or length."""
        s = self.sampling
        if s.logprobs is not None:
            self.logprobs.append((token, logprob, best[: s.logprobs]))
        self.sequence.output.append(token)
        if self.counts is not None:
            self.counts[token] += 1
        ended = token in eos and not s.ignore_eos
        done = ended or len(self.sequence.output) >= s.max_tokens
        new = ("" if ended else self.detokenized.add(token)) + (self.detokenized.finish() if done else "")
        checked = max(0, len(self.text) - max((len(stop) - 1 for stop in s.stop), default=0))
        self.text += new
        cut = min((i for i in (self.text.find(stop, checked) for stop in s.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.finish_reason = self.text[:cut], "stop"
        elif done:
            self.finish_reason = "stop" if ended else "length"

    def delta(self) -> str:
        """Text not sent yet; while unfinished, the tail that may begin a stop string is held back."""
        hold = 0 if self.finish_reason else max((len(stop) - 1 for stop in self.sampling.stop), default=0)
        end = max(self.sent, len(self.text) - hold)
        piece, self.sent = self.text[self.sent : end], end
        return piece


class Request:
    """A client's request: its choices, and ``notify(request)``, called on the engine's thread after each step
    that changed it (or with ``error`` set when the engine failed)."""

    def __init__(self, prompt: list, sampling: Sampling, notify):
        self.prompt, self.sampling, self.notify = list(prompt), sampling, notify
        self.arrived = time.monotonic()
        self.choices: list = []
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return bool(self.choices) and all(c.finish_reason for c in self.choices)
