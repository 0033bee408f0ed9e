"""The benchmark scripts run and check their own results (tiny sizes here; their numbers are not tested)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the scripts at tiny sizes: run with the slow tier (make test-all)

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize(
    "script, args, expect",
    [
        # folded (6 blocks) == whole graph; a small config for the mesh-against-plan timing
        (
            "plan_scaling.py",
            ["--layers", "6", "--world-size", "4", "--mesh-layers", "6", "--mesh-hidden", "512"],
            "yes",
        ),
        (
            "runtime.py",
            ["--layers", "1", "--hidden", "64", "--repeats", "1", "--decode-steps", "1"],
            "reference, autotp collectives",
        ),
        (
            "generate.py",
            ["--layers", "1", "--hidden", "64", "--new", "3", "--batch", "2", "--repeats", "1"],
            "autotp / hf",
        ),
        (
            "train.py",
            ["--layers", "1", "--hidden", "32", "--seq", "8", "--batch", "4", "--repeats", "1"],
            "autotp / hand-written memory",
        ),
        (
            "train.py",
            ["--layers", "1", "--hidden", "32", "--seq", "8", "--batch", "4", "--repeats", "1", "--compile"],
            "autotp / hand-written time",
        ),
        (
            "gpu.py",
            [
                "--sections",
                "training",
                "--sizes",
                '{"training": {"seq": 32, "layers": 1, "hidden": 128, "heads": 8, "kv": 8, "ffn": 256, "vocab": 512}}',
            ],
            "TP-8 rank 0, SP, compiled",
        ),
        ("dropout.py", ["--layers", "1", "--hidden", "32", "--repeats", "1"], "reference vs one process"),
        ("plan_speed.py", ["--layers-8b", "2", "--layers-70b", "2", "--hidden-scale", "0.0625"], "time to a plan"),
        ("serve_throughput.py", ["--layers", "1", "--hidden", "64", "--tokens", "4"], "autotp engine"),
        (
            "gpu.py",
            [
                "--sections",
                "serving",
                "--sizes",
                '{"serving": {"layers": 1, "hidden": 64, "heads": 4, '
                '"kv_heads": 2, "ffn": 128, "vocab": 128, "batches": [1, 4], "prompt": 8, "new": 6}}',
            ],
            "autotp_graphs_tok_s",
        ),
        ("gpu.py", ["--sections", "quantized"], "fp8_tokens_equal': True"),
    ],
)
def test_benchmark_runs(script, args, expect):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert expect in result.stdout, result.stdout
