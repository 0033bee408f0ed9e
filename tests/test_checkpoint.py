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
from autotp.runtime.hf_models import default_inputs
from tests.helpers import configs
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL
from tests.helpers.models import build, example_input, llama_with, logits, padded_prompts


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


def _pretrained_models(*directories: str) -> list:
    """The models ``autotp.from_pretrained`` builds from these directories and the inputs it captures them with."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    pairs = []
    for directory in directories:
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), torch_dtype=None)
        model.tie_weights()
        pairs.append((model.eval(), default_inputs(model)))
    return pairs


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
    run_ranks(4, _from_pretrained, directory, captures=functools.partial(_pretrained_models, directory))


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
        captures=functools.partial(_pretrained_models, str(tmp_path / "uneven"), str(tmp_path / "shared")),
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


def _tiny(kind: str):
    """transformers stores these under other names or shapes than the model holds (its conversion mapping)."""
    from transformers import GPTNeoXForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    if kind == "qwen3_moe":
        return Qwen3MoeForCausalLM(configs.qwen3_moe(num_experts=12)).eval()  # 12: expert 10 comes after 9, not after 1
    if kind == "mixtral":
        return MixtralForCausalLM(configs.mixtral()).eval()
    return GPTNeoXForCausalLM(
        configs.gpt_neox(hidden_size=32, intermediate_size=64, max_position_embeddings=2048)
    ).eval()


def test_stacked_experts_are_read_expert_by_expert_in_slices(tmp_path):
    """Each piece of a stacked [E, 2I, H] / [E, H, I] tensor equals that slice of the model transformers
    saved, and reads only the rows of each stored expert matrix it needs."""
    from autotp.placement import Shard, fill_ranges, piece_ranges
    from autotp.runtime.conversion import model_conversions
    from autotp.runtime.hf_checkpoint import Checkpoint

    for kind in ("mixtral", "qwen3_moe"):
        model = _tiny(kind)
        model.save_pretrained(tmp_path / kind)
        assert not any(".experts.gate_up_proj" in key for key in load_file(tmp_path / kind / "model.safetensors"))
        checkpoint = Checkpoint(tmp_path / kind, model_conversions(model))
        params = dict(model.named_parameters())
        assert set(checkpoint.files) == set(params)
        for name in [n for n, p in params.items() if p.dim() == 3 and n.startswith("model.layers.1.")]:
            full = params[name].detach()
            fused = [Shard(1, chunks=(full.shape[1] // 2,) * 2)] if "gate_up" in name else []  # gate | up, each split
            for placement in [Shard(0), Shard(1), Shard(2), *fused]:
                for world in (2, 3):
                    for rank in range(world):
                        expected = torch.cat(
                            [
                                full.narrow(placement.dim, start, length)
                                for start, length in placement.ranges(full.shape[placement.dim], rank, world)
                            ],
                            placement.dim,
                        )
                        ranges = piece_ranges(full.shape, placement, rank, world)
                        read = functools.partial(checkpoint.read_box, name)
                        piece = fill_ranges(torch.empty_like(expected), ranges, read, chunk_bytes=64)
                        assert torch.equal(piece, expected), (name, placement)
    reads = []
    stored_read = checkpoint._read_stored
    checkpoint._read_stored = lambda key, box: reads.append((key, box)) or stored_read(key, box)
    stacked = "model.layers.1.mlp.experts.gate_up_proj"
    ranges = piece_ranges(checkpoint.shape(stacked), Shard(1, chunks=(32, 32)), 1, 2)
    fill_ranges(torch.empty(12, 32, 32), ranges, lambda box: checkpoint.read_box(stacked, box))
    assert sorted((key.split(".")[-3:-1], box[0]) for key, box in reads) == sorted(
        ([str(e), w], slice(16, 32)) for e in range(12) for w in ("gate_proj", "up_proj")
    )  # half of each, no more


def test_conversions_autotp_cannot_slice_are_refused(tmp_path):
    from transformers.core_model_loading import Transpose, WeightConverter

    from autotp.runtime.hf_checkpoint import Checkpoint

    save_file(
        {f"layers.0.experts.{e}.w1.weight": torch.zeros(4, 2) for e in range(2)},
        tmp_path / "model.safetensors",
        metadata={"format": "pt"},
    )
    transposed = WeightConverter(".experts.*.w1.weight", ".experts.gate_proj", operations=[Transpose(0, 1)])
    with pytest.raises(autotp.CheckpointError, match=r"gate_proj.*\['Transpose'\].*cannot read"):
        Checkpoint(tmp_path, [transposed])


def _stored_layout_round_trip(rank: int, world: int, root: str) -> None:
    from transformers import AutoModelForCausalLM

    x = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(1))
    for kind in ("mixtral", "gpt_neox"):
        directory = f"{root}/{kind}"
        reference = AutoModelForCausalLM.from_pretrained(directory).eval()
        sharded = autotp.from_pretrained(directory)  # Mixtral: transformers' grouped_mm experts, captured on meta
        if kind == "mixtral":  # the experts are split, not replicated
            assert sharded.autotp_plan.params["model.layers.0.mlp.experts.gate_up_proj"] != "R"
        torch.testing.assert_close(logits(sharded(x)), logits(reference(x)), **TOL)
        if kind == "mixtral":  # greedy decoding from the slices read through the conversion mapping
            ids, mask = padded_prompts(96)
            got = autotp.generate(sharded, ids, mask, max_new_tokens=5, pad_token_id=0)
            want = reference.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
            assert torch.equal(got, want), (got, want)
        autotp.save_pretrained(sharded, f"{directory}-saved")
        if rank == 0:
            again = AutoModelForCausalLM.from_pretrained(f"{directory}-saved").eval()
            assert torch.equal(logits(again(x)), logits(reference(x)))


def test_transformers_stored_layouts_load_in_slices_and_save_bit_exactly(tmp_path):
    """Mixtral (experts stored per expert, stacked on load) and GPT-NeoX (``embed_out`` stored for ``lm_head``):
    loaded per rank, outputs equal transformers'; saved, every tensor is transformers' own, bit for bit."""
    for kind in ("mixtral", "gpt_neox"):
        _tiny(kind).save_pretrained(tmp_path / kind)
    directories = [str(tmp_path / kind) for kind in ("mixtral", "gpt_neox")]
    run_ranks(2, _stored_layout_round_trip, str(tmp_path), captures=functools.partial(_pretrained_models, *directories))
    for kind in ("mixtral", "gpt_neox"):
        original = load_file(tmp_path / kind / "model.safetensors")
        saved = load_file(tmp_path / f"{kind}-saved" / "model.safetensors")
        assert saved.keys() == original.keys()
        assert all(torch.equal(saved[name], tensor) for name, tensor in original.items())


def _mesh_saves(rank: int, world: int, root: str) -> None:
    """A Mixtral pipeline (2 stages x TP world/2) and the same Mixtral over DP 2 (FSDP2) x TP world/2, each saved."""
    from torch.distributed.device_mesh import init_device_mesh

    model = _with_buffer(_tiny("mixtral"))
    x = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(1))

    def loss_fn(output, target):
        return torch.nn.functional.cross_entropy(output.logits.flatten(0, 1), target.flatten())

    sizes = (2, world // 2)
    pipe = autotp.parallelize(
        model, (x,), mesh=init_device_mesh("cpu", sizes, mesh_dim_names=("pp", "tp")), loss_fn=loss_fn, stages=[0, 1]
    )
    assert any(".experts." in name for name, _ in pipe.named_parameters())  # this rank's stage holds experts
    assert all(t.is_meta for t in [*pipe.autotp_source.parameters(), *pipe.autotp_source.buffers()])  # no weights kept
    autotp.save_pretrained(pipe, f"{root}/pp")
    data_parallel = autotp.parallelize(model, (x,), mesh=init_device_mesh("cpu", sizes, mesh_dim_names=("dp", "tp")))
    autotp.save_pretrained(data_parallel, f"{root}/dp")


def _with_buffer(model):
    """A persistent buffer the forward reads (transformers' own models keep none): a checkpoint must hold it."""
    norm = model.model.norm
    norm.register_buffer("shift", torch.arange(norm.weight.numel(), dtype=torch.float32))
    norm.register_forward_hook(lambda module, args, out: out + 0 * module.shift)
    return model


def test_mesh_and_pipeline_saves_are_transformers_own_files(tmp_path):
    """Every save path writes transformers' stored names and per-expert layout, persistent buffers included: a
    Mixtral saved from pipeline stages and from DP x TP (2 ranks: TP 1, the cheapest mesh that runs each path) is
    transformers' own file, bit for bit, and transformers' from_pretrained reads it."""
    from transformers import AutoModelForCausalLM

    model = _with_buffer(_tiny("mixtral"))
    model.save_pretrained(tmp_path / "transformers")
    original = load_file(tmp_path / "transformers" / "model.safetensors")
    run_ranks(2, _mesh_saves, str(tmp_path))
    for path in ("pp", "dp"):
        saved = load_file(tmp_path / path / "model.safetensors")
        assert saved.keys() == original.keys(), sorted(saved.keys() ^ original.keys())[:6]
        assert all(torch.equal(saved[name], tensor) for name, tensor in original.items()), path
    x = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(1))
    assert "model.norm.shift" in original
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "pp").eval()
    assert torch.equal(logits(again(x)), logits(model(x)))
