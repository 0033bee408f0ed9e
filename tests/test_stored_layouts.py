"""Checkpoints in transformers' stored layouts: experts stored one by one and stacked on load, renamed tensors,
conversions autotp cannot slice (refused), and what pipelines and meshes save."""

from __future__ import annotations

import functools

import pytest
import torch
from safetensors.torch import load_file, save_file

import autotp
from tests.helpers import configs
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL
from tests.helpers.models import logits, padded_prompts, pretrained_models


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
    run_ranks(2, _stored_layout_round_trip, str(tmp_path), captures=functools.partial(pretrained_models, *directories))
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
