"""A served model for the endpoint's tests: a tiny LLaMA with random weights and a word-level tokenizer with a chat
template, both built here and saved with save_pretrained (no downloads), and the server started as a user starts it
(``autotp serve DIR --world-size N``) in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import time
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
