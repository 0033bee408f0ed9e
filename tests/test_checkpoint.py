"""Safetensors checkpoints: per-rank slice loading, clear errors, unsharded saving that round-trips."""

from __future__ import annotations

import functools
import gc
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import autotp
from autotp.api import checkpoint_source
from autotp.runtime.hf_checkpoint import check_tensors
from tests.helpers import configs
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL
from tests.helpers.models import build, example_input, llama_with, logits, pretrained_models


def _hf_dir(kind: str, directory: Path, max_shard_size: str | None = None) -> Path:
    model, _, _ = build(kind)
    model.save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return directory


def _empty(kind: str):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    model, args, _ = build(kind, device="meta")
    with init_empty_weights(include_buffers=False):
        empty = AutoModelForCausalLM.from_config(AutoConfig.for_model(**model.config.to_dict()))
    empty.tie_weights()
    return empty.eval(), args


def _empty_models(*kinds: str) -> list:
    """The (model, args) pairs ``_empty`` makes, for ``run_ranks(..., captures=...)``."""
    return [_empty(kind) for kind in kinds]


def _load_and_compare(rank: int, world: int, kind: str, directory: str) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(directory).eval()
    model, args = _empty(kind)
    sharded = autotp.parallelize(model, args, checkpoint=directory)
    assert all(not p.is_meta for p in sharded.parameters())
    x = example_input(kind, 3, 5)
    torch.testing.assert_close(logits(sharded(x)), logits(reference(x)), **TOL)
    full = autotp.full_state_dict(sharded)
    for name, p in reference.named_parameters():
        assert torch.equal(full[name], p.detach()), name


@pytest.mark.parametrize("kind,shards", [("llama", None), ("gpt2", "20KB")])
def test_meta_model_loads_its_slices(tmp_path, kind, shards):
    directory = _hf_dir(kind, tmp_path, shards)
    assert (directory / ("model.safetensors.index.json" if shards else "model.safetensors")).exists()
    run_ranks(2, _load_and_compare, kind, str(directory), captures=functools.partial(_empty_models, kind))


def _from_pretrained(rank: int, world: int, directory: str) -> None:
    from transformers import AutoModelForCausalLM

    sharded = autotp.from_pretrained(directory)
    reference = AutoModelForCausalLM.from_pretrained(directory).eval()
    torch.manual_seed(0)  # the same input on every rank
    x = example_input("llama", 1, 1)
    torch.testing.assert_close(logits(sharded(x)), logits(reference(x)), **TOL)
    q = dict(sharded.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape[0] * world == reference.model.layers[0].self_attn.q_proj.weight.shape[0]


def test_from_pretrained_on_four_ranks(tmp_path):
    directory = str(_hf_dir("llama", tmp_path))
    run_ranks(4, _from_pretrained, directory, captures=functools.partial(pretrained_models, directory))


def _uneven_and_shared(rank: int, world: int, root: str) -> None:
    from transformers import AutoModelForCausalLM

    from autotp.placement import parse, take_local

    for name, layouts in [("uneven", {"q_proj": "S(0/10)", "o_proj": "S(1/10)"}), ("shared", {"k_proj": "S(0/2)"})]:
        directory = f"{root}/{name}"
        sharded = autotp.from_pretrained(directory)
        reference = AutoModelForCausalLM.from_pretrained(directory).eval()
        params = sharded.autotp_plan.params
        full = reference.state_dict()
        local = dict(sharded.named_parameters())
        for key, layout in layouts.items():
            weight = next(n for n in params if key in n)
            assert params[weight] == layout, (weight, params[weight])
        for weight, p in local.items():  # each rank read exactly its own rows
            placement = parse(params[weight])
            want = take_local(full[weight], placement, rank, world) if placement != parse("R") else full[weight]
            assert torch.equal(p.detach(), want), weight
        torch.manual_seed(0)
        x = example_input("llama", 2, 3)
        torch.testing.assert_close(logits(sharded(x)), logits(reference(x)), **TOL)
        autotp.save_pretrained(sharded, f"{root}/{name}-saved")
        if rank == 0:
            saved = load_file(f"{root}/{name}-saved/model.safetensors")
            assert all(torch.equal(saved[k], full[k]) for k in saved) and saved.keys() == full.keys()


def test_uneven_and_shared_heads_load_their_slices_and_save(tmp_path):
    llama_with(heads=10, kv=10, vocab=101).save_pretrained(tmp_path / "uneven")
    llama_with(heads=8, kv=2).save_pretrained(tmp_path / "shared")
    run_ranks(
        4,
        _uneven_and_shared,
        str(tmp_path),
        captures=functools.partial(pretrained_models, str(tmp_path / "uneven"), str(tmp_path / "shared")),
    )


def _expect_error(rank: int, world: int, directory: str, message: str) -> None:
    model, args = _empty("llama")
    with pytest.raises(autotp.CheckpointError, match=message):
        autotp.parallelize(model, args, checkpoint=directory)


def test_bad_checkpoints_name_the_tensors(tmp_path):
    good = _hf_dir("llama", tmp_path / "good")
    tensors = load_file(good / "model.safetensors")
    cases = {
        "missing": (
            {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"},
            "missing: model.layers.1.mlp.up_proj.weight",
        ),
        "unexpected": ({**tensors, "model.extra.weight": torch.zeros(2)}, "unexpected: model.extra.weight"),
        "shape": (
            {**tensors, "model.norm.weight": torch.zeros(3)},
            r"shape mismatch: model.norm.weight is \(3,\) in the checkpoint, \(64,\) in the model",
        ),
    }
    model, _ = _empty("llama")
    for case, (content, message) in cases.items():
        directory = tmp_path / case
        directory.mkdir()
        save_file(content, directory / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(autotp.CheckpointError, match=message):  # the check parallelize runs, in one process
            check_tensors(checkpoint_source(str(directory), model), model)
    run_ranks(
        2,
        _expect_error,
        str(tmp_path / "missing"),
        cases["missing"][1],  # and as parallelize raises it
        captures=functools.partial(_empty_models, "llama"),
    )
    with pytest.raises(autotp.CheckpointError, match=r"no model\.safetensors"):
        autotp.runtime.hf_checkpoint.Checkpoint(tmp_path)


def _meta_without_checkpoint(rank: int, world: int, directory: str) -> None:
    model, args, _ = build("llama", device="meta")
    sharded = autotp.parallelize(model, args)  # torchtitan's idiom: this rank's pieces stay on meta
    assert all(t.is_meta for t in [*sharded.parameters(), *sharded.buffers()])
    full = model.model.layers[0].self_attn.q_proj.weight
    assert sharded.get_parameter("model.layers.0.self_attn.q_proj.weight").shape[0] * world == full.shape[0]
    with torch.device("meta"):  # a computed buffer, no config to rebuild it from: say what to do instead
        scaled = Scaled()
    with pytest.raises(autotp.CheckpointError, match=r"scale: computed at construction.*init_empty_weights"):
        autotp.parallelize(scaled, (torch.randn(2, 16),), checkpoint=directory)
    with torch.device("meta"):  # positions its forward makes on the meta device: refused, never made up
        picked = Picked()
    with pytest.raises(autotp.CheckpointError, match=r"lifted_tensor.*created on the meta device"):
        autotp.parallelize(picked, (torch.randn(2, 16),), checkpoint=directory)
    torch.distributed.barrier()  # a rank that returns early takes the rendezvous store with it


def _meta_models() -> list:
    """What ``_meta_without_checkpoint`` parallelizes (its refusals come after the capture, when loading)."""
    with torch.device("meta"):
        scaled, picked = Scaled(), Picked()
    return [build("llama", device="meta")[:2], (scaled, (torch.randn(2, 16),)), (picked, (torch.randn(2, 16),))]


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16), persistent=False)

    def forward(self, x):
        return self.proj(x) * self.scale


class Picked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.proj(x)[..., [-1, 3]]  # a Python list: a tensor constant of the captured program


def test_meta_model_without_checkpoint_stays_on_meta(tmp_path):
    """Without a checkpoint a meta model's pieces stay on meta at their local shapes; what cannot be filled later
    is refused: a computed buffer nothing rebuilds, positions the forward created on meta."""
    save_file(Scaled().state_dict(), tmp_path / "model.safetensors", metadata={"format": "pt"})
    run_ranks(2, _meta_without_checkpoint, str(tmp_path), captures=_meta_models)


META_IDIOM = {  # rotary tables (full, partial) are computed buffers; GPT-2's position table is a weight
    "llama": {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "gpt_neox": {
        "model_type": "gpt_neox",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "rotary_pct": 0.5,
    },
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_head": 4, "n_positions": 32},
}


def _torch_meta_idiom(rank: int, world: int, root: str) -> None:
    from transformers import AutoModelForCausalLM

    for kind in META_IDIOM:
        directory = f"{root}/{kind}"
        model, (x,) = _meta_idiom(directory)
        assert all(b.is_meta for b in model.buffers())
        sharded = autotp.parallelize(model, (x,), checkpoint=directory)
        reference = AutoModelForCausalLM.from_pretrained(directory).eval()
        torch.testing.assert_close(logits(sharded(x)), logits(reference(x)), **TOL, msg=lambda m, k=kind: f"{k}: {m}")
        for name, buffer in reference.named_buffers():
            assert torch.equal(dict(sharded.named_buffers())[name], buffer), (kind, name)


def _meta_idiom(directory: str) -> tuple:
    """PyTorch's own idiom (torchtitan): every tensor on meta, buffers too; and the input (the same on every rank)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory)).eval()
    torch.manual_seed(0)
    return model, (example_input("llama", 2, 7),)


def _meta_idioms(root: str) -> list:
    return [_meta_idiom(f"{root}/{kind}") for kind in META_IDIOM]


def test_torch_meta_device_models_rebuild_computed_buffers(tmp_path):
    from safetensors.torch import save_model
    from transformers import AutoConfig, AutoModelForCausalLM

    for kind, settings in META_IDIOM.items():
        torch.manual_seed(0)
        config = AutoConfig.for_model(**settings, vocab_size=96, num_hidden_layers=1, use_cache=False)
        config.save_pretrained(tmp_path / kind)  # weights under the model's own names (save_pretrained writes
        save_model(AutoModelForCausalLM.from_config(config), str(tmp_path / kind / "model.safetensors"))  # legacy ones)
    run_ranks(2, _torch_meta_idiom, str(tmp_path), captures=functools.partial(_meta_idioms, str(tmp_path)))


def _round_trip(rank: int, world: int, source: str, first: str, second: str) -> None:
    model, args = _empty("gpt2")
    sharded = autotp.parallelize(model, args, checkpoint=source)
    autotp.save_pretrained(sharded, first, max_shard_bytes=30_000)
    model, args = _empty("gpt2")
    again = autotp.parallelize(model, args, checkpoint=first)
    autotp.save_pretrained(again, second)


def test_save_round_trips_bit_exactly(tmp_path):
    source = _hf_dir("gpt2", tmp_path / "source")
    first, second = tmp_path / "first", tmp_path / "second"
    run_ranks(2, _round_trip, str(source), str(first), str(second), captures=functools.partial(_empty_models, "gpt2"))
    index = json.loads((first / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # large enough to be split, with an index
    assert (first / "config.json").exists() and (second / "model.safetensors").exists()
    original = load_file(source / "model.safetensors")
    saved = {}
    for file in set(index["weight_map"].values()):
        saved.update(load_file(first / file))
    resaved = load_file(second / "model.safetensors")
    assert saved.keys() == original.keys() == resaved.keys()
    for name, tensor in original.items():
        assert torch.equal(saved[name], tensor) and torch.equal(resaved[name], tensor), name


def _status(field: str) -> int:
    """Bytes from /proc/self/status: VmRSS now, VmHWM the peak since the last reset."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
        f.write("5")


def _bounded_load(rank: int, world: int, directory: str, expected: str, full: int, largest: int) -> None:
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory)).eval()
    ids = torch.arange(12).view(2, 6)
    gc.collect()
    before = _status("VmRSS")
    _reset_peak()
    sharded = autotp.parallelize(model, (ids,), checkpoint=directory)
    with torch.no_grad():
        out = sharded(ids).logits  # every weight page is touched by now
    growth = _status("VmHWM") - before
    print(
        f"rank {rank}: peak RSS grew {growth / 1e6:.0f} MB loading a {full / 1e6:.0f} MB model "
        f"(bound {(full / world + largest) / 1e6:.0f} MB + 150 MB)"
    )
    assert growth <= full / world + largest + 150e6
    assert growth < 0.6 * full
    torch.testing.assert_close(out, torch.load(expected), **TOL)


@pytest.mark.slow
def test_a_large_model_loads_within_a_quarter_per_rank(tmp_path):
    """1.35 GB of fp32 weights over 4 ranks: each rank's memory grows by about a quarter."""
    from transformers import LlamaForCausalLM

    config = configs.llama_1gb()
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    assert sum(sizes) >= 2**30
    model.save_pretrained(tmp_path, max_shard_size="400MB")
    with torch.no_grad():
        torch.save(model(torch.arange(12).view(2, 6)).logits, tmp_path / "expected.pt")
    full, largest = sum(sizes), max(sizes)
    del model
    run_ranks(4, _bounded_load, str(tmp_path), str(tmp_path / "expected.pt"), full, largest)
