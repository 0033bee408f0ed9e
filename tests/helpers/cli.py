"""The command line run as a user runs it: in a process, or (faster) in this one with its output, errors and exit
status as a process would give them; a tiny LLaMA's model directory to point it at."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from autotp.tools.cli import main
from tests.helpers import configs

ROOT = Path(__file__).resolve().parents[2]


def autotp_process(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m autotp.tools.cli ARGS``, as a user runs it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160"}
    return subprocess.run(
        [sys.executable, "-m", "autotp.tools.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def autotp(*args: str) -> subprocess.CompletedProcess:
    """The same command line in this process (a fresh interpreter spends seconds importing torch and transformers
    per call): its output, errors and exit status as a process would give them."""
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:  # both undone after the call
        patch.chdir(ROOT)  # model specs such as examples.mlp:build import from here, as under `python -m`
        patch.setattr(sys, "path", [*sys.path])  # a copy: the CLI adds the working directory to it
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args)) or 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
                err.write("" if isinstance(exc.code, int) or exc.code is None else str(exc.code))
            except Exception:
                traceback.print_exc(file=err)
                code = 1
    return subprocess.CompletedProcess(["autotp", *args], code, out.getvalue(), err.getvalue())


def tiny_llama_dir(tmp_path: Path) -> Path:
    configs.llama(
        vocab_size=256,
        intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        use_cache=True,
    ).save_pretrained(tmp_path)
    return tmp_path
