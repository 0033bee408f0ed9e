"""A served model for the endpoint's tests: a tiny LLaMA with random weights and a word-level tokenizer with a chat
template, both built here and saved with save_pretrained (no downloads), and the server started as a user starts it
(``autotp serve DIR --world-size N``) in a process of its own.  For the text's own checks: a byte-level BPE tokenizer
(as real models use: a character outside its training text is several byte tokens) and a LLaMA whose greedy tokens
are known (``save_cycle_model``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from tests.helpers import configs

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
ROLES = ["system", "user", "assistant"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)


def words(vocab: int) -> list[str]:
    """The tokenizer's vocabulary: specials, roles, then w7, w8, ... (one token a word)."""
    fixed = SPECIAL + ROLES
    return fixed + [f"w{i}" for i in range(len(fixed), vocab)]


def tokenizer(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words(vocab))}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )


def byte_tokenizer(vocab: int):
    """A byte-level BPE of at most ``vocab`` tokens (specials, the 256 bytes, merges of an English text), so 'é' is
    two tokens, '€' three and '😀' four; with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL + ROLES,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(["the quick brown fox jumps over the lazy dog; a server answers the user"] * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )


def save_cycle_model(directory: Path, cycle: list[int], rivals: list[int], seed: int = 0) -> torch.nn.Module:
    """A LLaMA over byte_tokenizer whose next token depends only on the last one: after ``cycle[i]`` the greedy
    token is ``cycle[i + 1]`` (wrapping), by 1 logit over ``rivals[i]`` and by 4 or so over any other token (so a
    penalty on the repeated cycle turns it to the rival).  Attention and MLP outputs are zero, so each position's
    hidden state is its token's embedding, and the LM head's rows point at their predecessors' normed embeddings."""
    from transformers import AutoModelForCausalLM

    words = byte_tokenizer(VOCAB)
    torch.manual_seed(seed)
    config = configs.llama(
        vocab_size=VOCAB, use_cache=True, bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=128
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hidden = model.model.norm(model.model.embed_tokens.weight)
        head = model.lm_head.weight
        head.normal_(0, 0.3 / hidden[cycle[0]].norm().item())  # other tokens' logits: spread about 0.3
        for before, after, rival in zip(cycle, cycle[1:] + cycle[:1], rivals, strict=True):
            toward = hidden[before] / hidden[before].norm() ** 2
            head[after], head[rival] = 6 * toward, 5 * toward
    model.save_pretrained(directory)
    words.save_pretrained(directory)
    return model


VOCAB = 320  # byte_tokenizer's and save_cycle_model's vocabulary


def save_model(directory: Path, family: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    """A causal LM of ``family`` (a function of tests/helpers/configs.py: llama, mixtral, ...) with a KV cache and
    ``overrides`` applied, and its tokenizer, saved in ``directory``; returns the model, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = getattr(configs, family)(
        **{
            "use_cache": True,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
            "max_position_embeddings": 128,
            **overrides,
        }
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory)
    tokenizer(config.vocab_size).save_pretrained(directory)
    return model


class Server:
    """``autotp serve`` in a process of its own, on a free port; stopped (SIGTERM) on exit."""

    def __init__(self, directory: Path, *args: str, world: int = 2, env: dict | None = None, torchrun: bool = False):
        from autotp.tools.spawn import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        bin_dir = Path(sys.executable).parent
        command = [str(bin_dir / "autotp"), "serve", str(directory), "--port", str(self.port), *args]
        if torchrun:  # each process one rank, as torchrun starts them
            command = [
                str(bin_dir / "torchrun"),
                "--nproc-per-node",
                str(world),
                "--master-port",
                str(free_port()),
                *command,
            ]
        else:
            command += ["--world-size", str(world)]
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"autotp serve exited with {self.process.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"autotp serve was not ready within {timeout} s:\n{self.output()}")

    def output(self) -> str:
        if self.process.poll() is None:
            return "(still running)"
        return self.process.stdout.read()

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.terminate()
        return self.process.wait(timeout)

    def __enter__(self):
        self.wait_ready()
        return self

    def __exit__(self, *exc):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()


def post(server: Server, path: str, body: bytes, *, key: str, content_type: str | None = "application/json"):
    """(status, JSON body) of a POST to the server, errors included (``content_type`` None: no such header)."""
    headers = {"Authorization": f"Bearer {key}", **({"Content-Type": content_type} if content_type else {})}
    request = urllib.request.Request(server.url + path, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def read_metrics(server: Server) -> dict:
    """/metrics as name -> value (histogram series by their labelled names)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as answer:
        lines = answer.read().decode().splitlines()
    return {k: float(v) for k, v in (line.split() for line in lines if not line.startswith("#"))}
