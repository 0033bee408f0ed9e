"""The command line, run as a user runs it."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _autotp(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160"}
    return subprocess.run([sys.executable, "-m", "autotp.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_demo_runs_sharded_and_matches():
    result = _autotp("demo")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "down_proj.weight" in out and "row" in out and "column" in out  # the plan table
    assert out.count("logits match single process: yes") == 2
    shares = [int(x) for x in re.findall(r"of [\d.]+ MB \((\d+)%\)", out)]
    assert len(shares) == 2 and all(s <= 55 for s in shares), shares  # about half of the parameters each
    assert "sharded == single-process" in out


def test_plan_writes_json(tmp_path):
    path = tmp_path / "plan.json"
    result = _autotp("plan", "examples.mlp:build", "--world-size", "2", "--json", "--out", str(path))
    assert result.returncode == 0, result.stderr[-3000:]
    printed, written = json.loads(result.stdout), json.loads(path.read_text())
    assert printed == written
    assert written["params"] == {"up.weight": "S(0)", "up.bias": "S(0)", "down.weight": "S(1)", "down.bias": "R"}
    assert [c["op"] for c in written["collectives"] if c["phase"] == "forward"] == ["all_reduce"]


def test_plan_bad_model_spec_is_a_clear_error():
    result = _autotp("plan", "no_such_module:build", "--world-size", "2")
    assert result.returncode != 0
    assert "cannot load 'no_such_module:build'" in result.stderr
