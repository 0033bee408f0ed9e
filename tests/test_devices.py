"""Every tensor a collective carries lives on a device its group's backend serves (runtime/devices.py).

On a CPU machine a group made as ``"cuda:gloo"`` refuses CPU tensors exactly as NCCL does ("No backend type
associated with device type cpu"): it stands in for NCCL here.  The serving engine's host messages go over a CPU
group of their own, a CPU model under such a group is refused before any capture, and a mixed group's shards go
to the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from autotp.runtime import devices
from autotp.tools.spawn import run_local
from tests.helpers.exact import TOL

CUDA_ONLY = "cuda:gloo"  # the backend map of a group that carries CUDA tensors only, as "nccl" does


class _Group:
    """A group as runtime/devices.py reads it: the device types its backends carry, and its size."""

    def __init__(self, *kinds: str, world: int = 2, one_backend: bool = False):
        self._device_types = [torch.device(kind) for kind in kinds]
        self.world = world
        self.backends = {kind: "gloo" if one_backend else object() for kind in kinds}

    def size(self) -> int:
        return self.world

    def _get_backend(self, device: torch.device):
        return self.backends[device.type]


@pytest.fixture
def a_gpu(monkeypatch):
    """This process as a rank whose current accelerator is cuda:0."""
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)


def test_a_mixed_group_puts_shards_on_the_gpu(a_gpu):
    assert devices.device_of(_Group("cpu", "cuda")) == torch.device("cuda", 0)  # "cpu:gloo,cuda:nccl"
    assert devices.device_of(_Group("cuda")) == torch.device("cuda", 0)  # "nccl"
    model = torch.nn.Linear(2, 2)  # on the CPU: its pieces are moved to the GPU of a GPU group
    assert devices.shard_device(_Group("cpu", "cuda"), model) == torch.device("cuda", 0)
    assert devices.shard_device(_Group("cuda"), model) == torch.device("cuda", 0)
    # plain gloo merely accepts CUDA tensors: a model stays where it is, a meta one goes to the GPU
    assert devices.shard_device(_Group("cpu", "cuda", one_backend=True), model) == torch.device("cpu")
    assert devices.shard_device(_Group("cpu", "cuda", one_backend=True), model.to("meta")).type == "cuda"


def test_a_device_the_group_does_not_carry_is_one_line():
    with pytest.raises(devices.DeviceError, match=r"^device='cpu', but .* carries no cpu tensors.*$") as caught:
        devices.shard_device(_Group("cuda"), torch.nn.Linear(2, 2), "cpu")
    assert "\n" not in str(caught.value)
    assert devices.shard_device(_Group("cuda", world=1), torch.nn.Linear(2, 2), "cpu") == torch.device("cpu")
    with pytest.raises(devices.DeviceError, match=r"the model is on cpu, and .* carries only cuda tensors"):
        devices.shard_device(_Group("cuda"), torch.nn.Linear(2, 2))  # no GPU here


def test_a_device_torch_cannot_name_is_refused_where_options_are_built():
    from autotp.options import RunOptions

    assert RunOptions(device="cuda:1").device == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"^device must name a device as torch does .* got 'gpu'$"):
        RunOptions(device="gpu")


def _served_model():
    import transformers

    from tests.helpers import configs

    torch.manual_seed(7)
    return transformers.LlamaForCausalLM(configs.llama(use_cache=True, max_position_embeddings=128)).eval()


def _refused_before_capture(rank: int, world: int) -> str:
    import autotp
    from autotp import api

    def captured(*_, **__):
        raise AssertionError("the model was captured before its device was checked")

    api.prepared_graph = captured
    try:
        autotp.parallelize(_served_model(), (torch.zeros(1, 4, dtype=torch.long),))
    except devices.DeviceError as exc:
        return str(exc)
    return "no error"


def test_a_cpu_model_under_a_group_that_carries_only_cuda_is_refused_before_capture():
    (message,) = run_local(1, _refused_before_capture, backend=CUDA_ONLY)
    assert message.startswith("the model is on cpu, and the process group's backend (cuda:gloo) carries only cuda")
    assert "\n" not in message


def _engine_steps(rank: int, world: int) -> list:
    """Three waves of requests, idle a while between them (the engine ticks), over a model kept on the CPU by
    ``device=`` under a group that refuses CPU tensors; every step's logits recorded."""
    import autotp
    from autotp.serving import engine as serving
    from autotp.serving.choices import Request, Sampling
    from tests.helpers.serving import tokenizer

    model = _served_model()
    sharded = autotp.parallelize(model, (torch.zeros(2, 8, dtype=torch.long),), device="cpu")
    engine = serving.Engine(
        sharded,
        tokenizer(model.config.vocab_size),
        blocks=32,
        block_size=4,
        max_num_seqs=4,
        max_batched_tokens=16,
        max_model_len=48,
    )
    seen, steps, ticks = {}, [], []
    choose, step, send = serving.Engine._choose, serving.Engine._step, serving.Engine._send

    def recording(self, logits, rows):
        for run, row in zip(rows, logits, strict=True):
            if run is not None and run.samples:
                seen.setdefault(id(run.sequence.owner[0]), []).append(row.clone())
        return choose(self, logits, rows)

    serving.Engine._choose = recording
    serving.Engine._step = lambda self, runs: (steps.append(len(runs)), step(self, runs))[1]
    serving.Engine._send = lambda self, message: (ticks.append(message == ("tick",)), send(self, message))[1]
    loop = threading.Thread(target=engine.run)
    loop.start()
    requests = []
    for wave in range(3):
        time.sleep(1.5 * serving.TICK_SECONDS)  # idle: at least one tick
        batch = [
            Request(
                [5 + (3 * wave + 7 * i + k) % 90 for k in range(3 + 4 * i)],
                Sampling(max_tokens=18, temperature=0, ignore_eos=True),
                lambda r: None,
            )
            for i in range(3)
        ]
        for request in batch:
            engine.submit(request)
        while not all(r.finished for r in batch):
            time.sleep(0.01)
        requests += batch
    engine.stop()
    loop.join()
    assert engine.error is None and engine.control is not engine.group  # the host's messages: a CPU group
    return [
        len(steps),
        sum(ticks),
        [(r.prompt, r.choices[0].sequence.output, torch.stack(seen[id(r.choices[0])]).tolist()) for r in requests],
    ]


def test_the_engine_serves_under_a_group_that_refuses_cpu_tensors():
    """Before: the engine broadcast its CPU step tensors over the model's group, which fails at its first tick."""
    steps, ticks, answers = run_local(1, _engine_steps, backend=CUDA_ONLY, timeout=300)[0]
    assert steps >= 50 and ticks >= 3
    model = _served_model()
    for prompt, output, logits in answers:
        with torch.no_grad():
            ref = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
        torch.testing.assert_close(torch.tensor(logits), ref, **TOL)


def test_the_gpu_check_rehearses_on_the_cpu():
    """benchmarks/gpu.py's sections for the NCCL path, as a GPU runs them but tiny and on gloo: ``autotp serve``
    answering the openai client as transformers would, and two ranks with parallelize, FSDP2 and generate."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu.py"
    result = subprocess.run(
        [
            sys.executable,
            str(script),
            "--sections",
            "environment,serve,two_ranks_gloo_cuda",
            "--sizes",
            '{"serve": {"layers": 2, "hidden": 64, "tokens": 6}}',
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "'equal': True" in result.stdout and "'exact': True" in result.stdout
