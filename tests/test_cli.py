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


def _tiny_llama_dir(tmp_path: Path) -> Path:
    from transformers import LlamaConfig
    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=4).save_pretrained(tmp_path)
    return tmp_path


def test_plan_from_a_config_with_a_topology(tmp_path):
    model_dir = _tiny_llama_dir(tmp_path)
    result = _autotp("plan", str(model_dir / "config.json"), "--world-size", "4", "--topology", "dgx-a100",
                     "--seq", "64", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout)
    assert plan["topology"] == "dgx-a100" and plan["world_size"] == 4
    assert plan["params"]["model.layers.1.mlp.down_proj.weight"] == "S(1)"
    assert plan["cost"]["memory"]["optimizer"] > 0


def test_mesh_prices_every_split(tmp_path):
    model_dir = _tiny_llama_dir(tmp_path)
    result = _autotp("mesh", str(model_dir), "--topology", "2x-dgx-h100", "--devices", "16", "--batch", "16",
                     "--seq", "32")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split("│")[1:3] for line in result.stdout.splitlines() if line.count("│") >= 5]
    assert sorted(int(tp) for tp, _ in rows) == [1, 2, 4, 8, 16]
    assert "best: TP" in result.stdout
