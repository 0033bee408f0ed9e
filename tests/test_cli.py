"""The command line, run as a user runs it."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from autotp.plan import Plan
from tests.helpers import configs
from tests.helpers.cli import autotp, autotp_process, tiny_llama_dir


def test_demo_runs_sharded_and_matches():
    result = autotp_process("demo")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "down_proj.weight" in out and "row" in out and "column" in out  # the plan table
    assert out.count("logits match single process: yes") == 2
    shares = [int(x) for x in re.findall(r"of [\d.]+ MB \((\d+)%\)", out)]
    assert len(shares) == 2 and all(s <= 55 for s in shares), shares  # about half of the parameters each
    assert "sharded == single-process" in out


def test_plan_writes_json(tmp_path):
    path = tmp_path / "plan.json"
    result = autotp("plan", "examples.mlp:build", "--world-size", "2", "--json", "--out", str(path))
    assert result.returncode == 0, result.stderr[-3000:]
    printed, written = json.loads(result.stdout), json.loads(path.read_text())
    assert printed == written
    assert written["params"] == {"up.weight": "S(0)", "up.bias": "S(0)", "down.weight": "S(1)", "down.bias": "R"}
    assert [c["op"] for c in written["collectives"] if c["phase"] == "forward"] == ["all_reduce"]


def test_plan_bad_model_spec_is_a_clear_error():
    result = autotp_process("plan", "no_such_module:build", "--world-size", "2")
    assert result.returncode != 0
    assert "cannot load 'no_such_module:build'" in result.stderr


def test_plan_from_a_config_with_a_topology(tmp_path):
    model_dir = tiny_llama_dir(tmp_path)
    result = autotp(
        "plan", str(model_dir / "config.json"), "--world-size", "4", "--topology", "dgx-a100", "--seq", "64", "--json"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout)
    assert plan["topology"] == "dgx-a100" and plan["world_size"] == 4
    assert plan["params"]["model.layers.1.mlp.down_proj.weight"] == "S(1)"
    assert plan["cost"]["memory"]["optimizer"] > 0


def test_mesh_prices_every_split(tmp_path):
    model_dir = tiny_llama_dir(tmp_path)
    result = autotp(
        "mesh", str(model_dir), "--topology", "2x-dgx-h100", "--devices", "16", "--batch", "16", "--seq", "32"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [[int(x) for x in line.split("│")[1:4]] for line in result.stdout.splitlines() if line.count("│") >= 5]
    assert sorted(tp for tp, _, _ in rows) == [1, 2, 4, 8]  # TP inside a node; 2 blocks are too few to pipeline
    assert all(tp * pp * dp == 16 for tp, pp, dp in rows)
    assert "mesh choice: TP" in result.stdout
    from autotp.planning.mesh_search import TIE

    marked = [line for line in result.stdout.splitlines() if line.count("│") >= 5 and "chosen" in line]
    assert len(marked) == 1, result.stdout  # the chosen row is marked, and the rule that chose it stated
    assert f"within {TIE:.0%} of the fastest estimate" in " ".join(result.stdout.split())


def test_mesh_json_for_a_cluster_of_nodes(tmp_path):
    configs.llama(
        vocab_size=256,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        use_cache=True,
    ).save_pretrained(tmp_path)
    node = tmp_path / "two-gpu-node.json"  # a node type of one's own, extending a known one
    node.write_text(
        json.dumps(
            {
                "name": "two-gpu-node",
                "extends": "dgx-a100",
                "figures": {
                    "gpus_per_node": {"value": 2, "source": "test"},
                    "nics_per_node": {"value": 2, "source": "test"},
                },
            }
        )
    )
    result = autotp(
        "mesh",
        str(tmp_path),
        "--topology",
        str(node),
        "--nodes",
        "8",
        "--global-batch",
        "32",
        "--seq",
        "32",
        "--data-parallel",
        "ddp",
        "--json",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert {"choice", "step_seconds", "memory_bytes", "mfu", "candidates"} <= set(out)
    choice = out["choice"]
    assert {"tp", "pp", "dp", "microbatches", "schedule", "stages"} <= set(choice)
    assert choice["tp"] * choice["pp"] * choice["dp"] == 16 and out["devices"] == 16 and choice["tp"] <= 2
    assert [b for start, end in choice["stages"] for b in range(start, end)] == list(range(8))
    assert out["step_seconds"] > 0 and out["memory_bytes"] > 0 and out["data_parallel"] == "ddp"
    assert len(out["memory"]) == choice["pp"]  # each pipeline rank's terms; the largest total is memory_bytes
    assert max(sum(terms.values()) for terms in out["memory"]) == pytest.approx(out["memory_bytes"])
    assert all({"tp", "pp", "dp", "step_seconds", "memory_bytes", "note"} <= set(c) for c in out["candidates"])


def test_show_diff_and_explain_a_saved_plan(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path, world in ((a, "2"), (b, "4")):
        result = autotp("plan", "examples.nanogpt:build", "--world-size", world, "--out", str(path))
        assert result.returncode == 0, result.stderr[-3000:]
        assert "collectives per step, by block" in result.stdout and "h.0" in result.stdout
    shown = autotp("show", str(a))
    assert shown.returncode == 0 and "column (fused 3 blocks)" in shown.stdout and "memory per device" in shown.stdout
    diff = autotp("diff", str(a), str(b))
    assert diff.returncode == 0 and "same model" in diff.stdout
    assert re.search(r"world size\s*│\s*2\s*│\s*4", diff.stdout)
    explain = autotp("explain", str(a), "h.0.mlp.2")
    assert explain.returncode == 0, explain.stderr
    rows = [line for line in explain.stdout.splitlines() if "aten.linear.default" in line]
    assert len(rows) >= 3 and sum("chosen" in r for r in rows) == 1
    assert "S(1)" in next(r for r in rows if "chosen" in r)  # the row split was chosen
    missing = autotp("explain", str(a), "no.such.module")
    assert missing.returncode != 0 and "no op named" in missing.stderr
    (tmp_path / "bad.json").write_text('{"version": 1, "world_size": "two"}')
    bad = autotp("show", str(tmp_path / "bad.json"))
    assert bad.returncode != 0 and "not an autotp plan" in bad.stderr


def test_compare_with_transformers_plans(tmp_path):
    llama = tiny_llama_dir(tmp_path / "llama")
    phi3 = tmp_path / "phi3"
    configs.phi3(
        vocab_size=256,
        intermediate_size=128,
        num_key_value_heads=4,
        pad_token_id=0,
        max_position_embeddings=4096,
        use_cache=True,
    ).save_pretrained(phi3)
    for model_dir in (llama, phi3):
        result = autotp("compare", str(model_dir), "--world-size", "2", "--seq", "64", "--against", "hf")
        assert result.returncode == 0, result.stderr[-3000:]
        rows = {
            cells[0]: cells[1:]
            for line in result.stdout.splitlines()
            if len(cells := [c.strip() for c in line.split("│")[1:-1]]) == 3
        }
        assert all(float(v) > 0 for v in rows["est. step µs"] + rows["parameter MB/device"])
        forward = [sum(int(v[i]) for k, v in rows.items() if k.startswith("forward")) for i in (0, 1)]
        assert forward[1] <= forward[0], rows  # autotp never needs more forward collectives than HF's plan
        if model_dir == phi3:  # HF gathers the fused qkv and gate_up outputs: two all-gathers a layer
            assert int(rows["forward all_gather"][0]) >= 4, rows


def test_plan_serve_prints_what_a_deployment_is_sized_by(tmp_path):
    """`autotp plan --serve`: prefill per 1,000 tokens, a decode step and tokens/s at the batch, the KV cache a
    sequence holds and how many fit; --max-decode-ms names the smallest TP size that meets it."""
    llama = tiny_llama_dir(tmp_path / "llama")
    result = autotp(
        "plan",
        str(llama),
        "--serve",
        "--context",
        "128",
        "--max-batch",
        "4",
        "--world-size",
        "2",
        "--max-decode-ms",
        "1000",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = result.stdout.strip().splitlines()[-2:]
    assert re.fullmatch(
        r"TP 2, context 128, batch 4: prefill [\d.]+ ms per 1,000 tokens \(in chunks of 512\); decode [\d.]+ ms a step "
        r"\(reading the weights and cache at memory bandwidth: [\d.]+ ms\), [\d,]+ tokens/s; KV cache "
        r"[\d.]+ MiB a sequence per device: \d+ sequences of 128 tokens fit beside the weights in 90% "
        r"of a device \(estimates\)",
        first,
    ), first
    assert second.startswith("TP 1 is the smallest size that decodes a step within 1000.0 ms (TP 1 "), second
    bad = autotp("plan", str(llama), "--serve", "--world-size", "2", "--memory-fraction", "1.5")
    assert bad.returncode == 2 and bad.stderr.strip().startswith("autotp: --memory-fraction must be in (0, 1]")
    serve = ("plan", str(llama), "--serve", "--world-size", "2", "--context", "128")
    fewer = autotp(*serve, "--max-batch", "4000", "--memory-fraction", "1e-4")  # 8 MB a device
    assert fewer.returncode == 0, fewer.stderr[-3000:]
    said, line = fewer.stdout.strip().splitlines()[-2:]
    fit = int(re.search(r": (\d+) sequences of 128 tokens do", said)[1])
    assert said.startswith("--max-batch 4000 does not fit at TP 2: ") and 0 < fit < 4000, said
    assert f"batch {fit}:" in line and f"{fit} sequences of 128 tokens fit" in line, line  # planned for those
    none = autotp(*serve, "--memory-fraction", "1e-9")
    assert none.returncode == 1 and none.stderr.startswith("autotp: not one sequence of 128 tokens fits at TP 2")


def test_compare_against_megatron_prices_each_plan_no_cheaper_than_autotps(tmp_path):
    """`--against`: Megatron's plan with and without sequence parallelism beside autotp's, one column each, all
    priced by the one price; autotp's estimate is the lowest; a plan naming no module is said, not shown."""
    llama = tiny_llama_dir(tmp_path / "llama")
    result = autotp("compare", str(llama), "--world-size", "2", "--seq", "64", "--against", "megatron", "megatron-sp")
    assert result.returncode == 0, result.stderr[-3000:]
    header = next(line for line in result.stdout.splitlines() if "┃" in line)
    assert [c.strip() for c in header.split("┃")[1:-1]] == ["", "Megatron", "Megatron + SP", "autotp"], header
    rows = {
        cells[0]: cells[1:]
        for line in result.stdout.splitlines()
        if len(cells := [c.strip() for c in line.split("│")[1:-1]]) == 4
    }
    megatron, split, ours = (float(v) for v in rows["est. step µs"])
    assert ours <= min(megatron, split), rows
    gpt2 = tmp_path / "gpt2"
    configs.gpt2(n_layer=1, n_embd=32, n_head=4, vocab_size=64).save_pretrained(gpt2)
    other = autotp("compare", str(gpt2), "--world-size", "2", "--seq", "16", "--against", "megatron")
    assert other.returncode == 1 and "no megatron plan names modules of GPT2LMHeadModel" in other.stdout, other


def _llama_config(path: Path, heads: int, kv: int, head_dim: int, vocab: int, layers: int = 1) -> Path:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": heads * head_dim,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": 3584,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
    }
    path.write_text(json.dumps(config))
    return path


def test_plan_calls_out_uneven_and_shared_heads(tmp_path):
    uneven = _llama_config(tmp_path / "uneven.json", heads=10, kv=10, head_dim=128, vocab=32001)
    result = autotp("plan", str(uneven), "--world-size", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") > 3}
    assert "uneven heads: 3,3,2,2 of 10" in rows["model.layers.0.self_attn.q_proj.weight"]
    assert "384x1280" in rows["model.layers.0.self_attn.q_proj.weight"]  # rank 0 holds 3 heads of 128
    shared = _llama_config(tmp_path / "shared.json", heads=8, kv=2, head_dim=128, vocab=32000)
    result = autotp("plan", str(shared), "--world-size", "4", "--inference")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") > 3}
    for proj in ("k_proj", "v_proj"):
        assert "2 heads each replicated on 2 ranks" in rows[f"model.layers.0.self_attn.{proj}.weight"]


def _rows(text: str) -> dict:
    """The parameter table's rows (the first table; the collectives table follows it)."""
    return {
        cells[0]: cells[1:]
        for line in text.split("collectives per")[0].splitlines()
        if len(cells := [c.strip() for c in line.split("│")[1:-1]]) == 4
    }


def test_plan_folds_a_deep_model_and_its_table(tmp_path):
    """Planned from four blocks; the parameter table shows a run of alike blocks once, --all every row."""
    from rich.console import Console

    from autotp.tools.report import plan_table

    deep = _llama_config(tmp_path / "deep.json", heads=8, kv=8, head_dim=16, vocab=1000, layers=12)
    result = autotp("plan", str(deep), "--world-size", "2", "--inference", "--out", str(tmp_path / "folded.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "12 identical blocks of model.layers planned from four" in result.stdout
    rows = _rows(result.stdout)
    assert "row" in rows["model.layers.0.mlp.down_proj.weight"][0]
    assert rows["model.layers.1 … model.layers.11"][0] == "each as model.layers.0 (11 blocks)"
    assert not any(name.startswith("model.layers.5.") for name in rows)
    whole = autotp(
        "plan",
        str(deep),
        "--world-size",
        "2",
        "--inference",
        "--no-fold",
        "--all",
        "--out",
        str(tmp_path / "whole.json"),
    )
    assert whole.returncode == 0, whole.stderr[-3000:]
    folded, unfolded = Plan.load(tmp_path / "folded.json"), Plan.load(tmp_path / "whole.json")
    assert folded.fold == {"path": "model.layers", "count": 12} and unfolded.fold is None
    assert folded.params == unfolded.params and len(folded.nodes) < len(unfolded.nodes)
    assert set(_rows(whole.stdout)) == set(unfolded.params)  # --all: every parameter, one row each
    folded.params["model.layers.5.mlp.down_proj.weight"] = "R"  # block 5 differs: it ends one run and starts none
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(plan_table(folded))
    rows = _rows(console.export_text())
    assert rows["model.layers.1 … model.layers.4"][0] == "each as model.layers.0 (4 blocks)"
    assert rows["model.layers.5.mlp.down_proj.weight"][1] == "R" and "model.layers.6.mlp.up_proj.weight" in rows
    assert rows["model.layers.7 … model.layers.11"][0] == "each as model.layers.6 (5 blocks)"


def test_plans_and_meshes_draw_as_pictures(tmp_path):
    """`--svg` / `--html`: one block's shown ops each with its output placement's colour and every collective of
    the block beside its value; the mesh planner's layouts one row each, the chosen one alone in green."""
    import xml.etree.ElementTree as ET

    config = _llama_config(tmp_path / "c.json", heads=8, kv=2, head_dim=16, vocab=1000, layers=6)
    result = autotp(
        "plan",
        str(config),
        "--world-size",
        "2",
        "--svg",
        str(tmp_path / "p.svg"),
        "--html",
        str(tmp_path / "p.html"),
        "--out",
        str(tmp_path / "p.json"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    plan = Plan.load(tmp_path / "p.json")
    texts = [e.text or "" for e in ET.parse(tmp_path / "p.svg").iter() if e.tag.endswith("text")]
    block = [c for c in plan.collectives if (c["module"] + ".").startswith("model.layers.1.")]
    assert sum(t.startswith(("all_reduce", "all_gather", "reduce_scatter")) for t in texts) == len(block) > 0
    assert any("q_proj" in t and "linear" in t for t in texts)
    assert (tmp_path / "p.svg").read_text() in (tmp_path / "p.html").read_text()
    mesh = autotp(
        "mesh", str(config), "--topology", "dgx-h100", "--global-batch", "8", "--json", "--svg", str(tmp_path / "m.svg")
    )
    assert mesh.returncode == 0, mesh.stderr[-3000:]
    candidates = json.loads(mesh.stdout)["candidates"]
    root = ET.parse(tmp_path / "m.svg").getroot()
    rows = [e.text for e in root.iter() if e.tag.endswith("text") and (e.text or "").startswith("TP ")]
    assert len(rows) == len(candidates)
    assert sum(e.get("fill") == "#27ae60" for e in root.iter() if e.tag.endswith("rect")) == 1


def test_long_work_shows_progress_on_a_terminal_and_nothing_when_piped():
    """Capturing and solving draw rich progress bars where stderr is a terminal, and print nothing when it is piped
    (issue 34: progress on long work, quiet otherwise)."""
    from rich.console import Console

    import autotp
    from autotp.tools.progress_bars import progress_bars
    from examples.mlp import build

    shown, piped = io.StringIO(), io.StringIO()
    for out, terminal in ((shown, True), (piped, False)):
        with progress_bars(Console(file=out, force_terminal=terminal, width=120)):
            model, example = build()
            autotp.plan(model, example, world_size=2)
    assert "capturing" in shown.getvalue() and "solving the plan for 2 ranks" in shown.getvalue()
    assert piped.getvalue() == ""
