"""Dry runs on PyTorch's fake process group (torchtitan's ``comm.mode="fake_backend"``): one process acting as any
rank of a large pp x dp x tp mesh builds that rank's stage on the meta device and holds its share of the weights."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from autotp.tools.spawn import exit_quietly, local_context
from tests.helpers import configs


def _gpt2(layers: int, hidden: int, heads: int, vocab: int, positions: int):
    from transformers import GPT2LMHeadModel

    config = configs.gpt2(
        vocab_size=vocab,
        n_positions=positions,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    )
    with torch.device("meta"):
        return GPT2LMHeadModel(config)


def _share(layers: int, hidden: int, vocab: int, positions: int, stage: int, sizes: tuple) -> float:
    """Parameters a rank of ``stage`` holds, counted from GPT-2's architecture by hand: the stage's blocks (attention
    qkv and output, MLP up and down with their biases, two layer norms), the token and position embeddings on the
    first stage, the final norm and the tied head's copy on the last, split over TP and DP ranks."""
    pp, dp, tp = sizes
    block = 12 * hidden * hidden + 13 * hidden
    count = layers // pp * block
    if stage == 0:
        count += vocab * hidden + positions * hidden
    if stage == pp - 1:
        count += 2 * hidden + vocab * hidden
    return count / (tp * dp)


def _rank(rank: int, sizes: tuple, shape: dict, seq: int, queue) -> None:
    """One process, one rank of the fake mesh: its stage's parameters (local numbers, all on meta) and the time."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autotp

    torch.set_num_threads(1)
    world = sizes[0] * sizes[1] * sizes[2]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        start = time.perf_counter()
        model = _gpt2(**shape)
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=("pp", "dp", "tp"))
        tokens = torch.zeros(sizes[0], seq, dtype=torch.long)  # one sequence per micro-batch, one per stage
        per = shape["layers"] // sizes[0]
        pipe = autotp.parallelize(
            model,
            (tokens,),
            mesh=mesh,
            loss_fn=lambda out, y: out.logits.sum(),
            stages=list(range(0, shape["layers"], per)),
        )
        params = list(pipe.parameters())
        held = sum(p.to_local().numel() for p in params)
        queue.put((rank, list(pipe.modules), held, all(p.is_meta for p in params), time.perf_counter() - start))
    except Exception as exc:  # reported to the test, which raises it
        queue.put((rank, None, f"{type(exc).__name__}: {exc}", False, 0.0))
    queue.close()
    queue.join_thread()
    exit_quietly()


def _dry_run(ranks: list, sizes: tuple, shape: dict, seq: int) -> list:
    ctx = local_context()
    queue = ctx.Queue()
    found = []
    for rank in ranks:  # one at a time: each is one process standing for one rank
        process = ctx.Process(target=_rank, args=(rank, sizes, shape, seq, queue))
        process.start()
        found.append(queue.get(timeout=1800))
        process.join(timeout=60)
    return found


def _check(ranks: list, sizes: tuple, shape: dict, seq: int) -> list:
    reports = _dry_run(ranks, sizes, shape, seq)
    for rank, stages, held, on_meta, seconds in reports:
        assert stages is not None, held
        (stage,) = stages
        want = _share(shape["layers"], shape["hidden"], shape["vocab"], shape["positions"], stage, sizes)
        print(
            f"rank {rank}: stage {stage}, {held / 1e6:.2f}M parameters held, {want / 1e6:.2f}M counted by hand, "
            f"built in {seconds:.1f} s"
        )
        assert on_meta
        assert abs(held / want - 1) < 0.05, (rank, held, want)
    return reports


def test_a_rank_of_a_fake_mesh_builds_its_stage_on_meta():
    """pp 2 x dp 2 x tp 2 (8 ranks) in one process per rank: the first and the last rank, each its own stage."""
    shape = {"layers": 4, "hidden": 256, "heads": 4, "vocab": 512, "positions": 64}
    reports = _check([0, 7], (2, 2, 2), shape, 16)
    assert [r[1] for r in reports] == [[0], [1]]


@pytest.mark.slow
def test_gpt3_175b_on_1024_fake_ranks():
    """GPT-3 175B's shape (96 layers, hidden 12288, tied embeddings) on pp 8 x dp 16 x tp 8, ranks 0 and 1023."""
    shape = {"layers": 96, "hidden": 12288, "heads": 96, "vocab": 50257, "positions": 2048}
    reports = _check([0, 1023], (8, 16, 8), shape, 2048)
    assert [r[1] for r in reports] == [[0], [7]]


ROOT = Path(__file__).resolve().parents[1]
TERMS = [
    "parameters",
    "gradients",
    "optimizer",
    "gathered parameters",
    "gathered gradients",
    "activations",
    "buffers",
    "dispatch",
]
# the README's 1,024-rank command at 8 ranks: every flag it passes, at the sizes of docs/scale.md's small command
# (--layers 6 --batch 8 --seq 16, the example's defaults for the rest; six blocks: the planner folds them)
SMALL = {
    "--tp": "2",
    "--dp": "2",
    "--pp": "2",
    "--layers": "6",
    "--hidden": "64",
    "--heads": "4",
    "--kv-heads": "2",
    "--vocab": "256",
    "--seq": "16",
    "--batch": "8",
    "--world-size": "8",
    "--rank": "7",
}


def readme_dry_run() -> list[str]:
    """The dry-run command of the README (``python examples/train.py ... --dry-run ...``) as arguments."""
    readme = (ROOT / "README.md").read_text()
    command = next(block for block in re.findall(r"```bash\n(.*?)```", readme, re.S) if "--dry-run" in block)
    return shlex.split(command.replace("\\\n", " "))


def test_the_readmes_dry_run_command_runs_at_eight_ranks():
    """The README's command for one rank of a 1,024-rank mesh, run as it is written with small sizes: rank 7 of
    TP 2 x DP 2 x PP 2 builds its stage on the fake backend and prints what it holds, term by term, beside the
    planner's figure for each term of the same layout and pipeline rank.
    Run as a user runs it, a process, with a terminal's progress bars on stderr (FORCE_COLOR: rich draws as on a
    terminal) for the capture and the solves, and no torch.export log lines or warnings among them (issue 34)."""
    python, script, *args = readme_dry_run()
    assert (python, script) == ("python", "examples/train.py") and "--dry-run" in args, args
    flags = [a for a in args if a.startswith("--")]
    assert set(SMALL) <= set(flags), sorted(set(SMALL) - set(flags))  # the README still passes each of them
    small = [SMALL.get(args[i - 1], a) if i and args[i - 1] in SMALL else a for i, a in enumerate(args)]
    run = subprocess.run(
        [sys.executable, script, *small],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "FORCE_COLOR": "1", "COLUMNS": "200"},
    )
    printed, shown = run.stdout, run.stderr
    assert run.returncode == 0, shown
    assert re.search(
        r"rank 7 of 8 \(TP 2 x DP 2 x PP 2, pipeline rank 1, 1f1b, 2 micro-batches of 2\), built on meta in .* s",
        printed,
    ), printed
    rows = re.findall(r"^  ([a-z ]+?) +(?:([\d.e+-]+) MiB|-) \| +([\d.e+-]+) MiB", printed, re.M)
    assert [term for term, _, _ in rows] == [*TERMS, "total"], printed  # every term, each priced by the planner
    for term, held, priced in rows[:3]:  # parameters, gradients, optimizer: held on meta and priced, the same bytes
        assert float(held) == pytest.approx(float(priced), rel=0.01), (term, printed)
    assert "capturing LlamaForCausalLM with torch.export" in shown and "solving the plan for 2 ranks" in shown, shown
    assert not re.search(r"Warning|non_strict_utils|specialized|^[WI]\d{4} ", shown, re.M), shown
