"""Quantized checkpoints sharded by the plan: transformers' FP8 block-wise format and GPTQ int4, checked against
independent references (transformers' own FP8 dequantization, GPTQ's packing written from its definition, the
checkpoint dequantized into a full-precision model in one process)."""

from __future__ import annotations

import functools
import json
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import autotp
from autotp.runtime.quantized import QuantizationError, quantization
from autotp.runtime.quantized_ops import fp8_dequantized, int4_dequantized, pack_int4, unpack_int4
from tests.helpers import configs
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL, sums_per_block
from tests.helpers.models import pretrained_models
from tests.helpers.quantized import fp8_checkpoint, fp8_quantized, gptq_checkpoint

BLOCK, GROUP = (16, 16), 16  # heads of 16 and an MLP of 13 blocks (208): uneven at 2, 3 and 4 ranks


def test_fp8_blocks_dequantize_as_transformers_does():
    """A ragged grid (40 x 70 in blocks of 16 x 32: 3 x 3 blocks, the last ones cut) read as transformers reads it."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    torch.manual_seed(0)
    weight, scale = fp8_quantized(torch.randn(40, 70), (16, 32))
    assert scale.shape == (3, 3)
    want = _dequantize_fp8_weight(weight, scale, [16, 32], torch.float32)
    assert torch.equal(fp8_dequantized(weight, scale, 16, 32), want)


def test_gptq_packing_golden_word():
    """GPTQ's packing by its definition: value i of a word at bits 4i; v1 stores each zero one less."""
    word = torch.tensor([[0x76543210], [-0x0123_4568]], dtype=torch.int32)  # 0xFEDCBA98 as int32
    assert unpack_int4(word, 1).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]
    assert unpack_int4(word, 0)[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    assert torch.equal(pack_int4(unpack_int4(word, 0), 0), word)
    # 8 inputs (one group, one word) of 8 outputs (one word of zeros): output 0's values 0..7, its zero stored 2
    # (so 3), scale 0.5 -> 0.5 * (v - 3); the other outputs' values and stored zeros 0 (so 1)
    qweight = torch.tensor([[0x76543210, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    qzeros = torch.tensor([[0x2]], dtype=torch.int32)
    weight = int4_dequantized(qweight, torch.full((1, 8), 0.5, dtype=torch.float16), qzeros, 8)
    assert weight[:, 0].tolist() == [-1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0]
    assert weight[:, 1:].eq(-0.5).all()


def _store_experts_fp8(directory, fused: bool) -> None:
    """The checkpoint's routed experts stored FP8 too, in blocks of 16: each expert's gate, up and down projections
    under their own names (DeepSeek-V3's and Qwen3's FP8 files), or the stacked tensors with a ``_scale_inv`` beside
    each (transformers' FP8 experts as it saves them)."""
    stored = load_file(f"{directory}/model.safetensors")
    for name in [n for n in stored if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        experts, prefix = stored.pop(name), name.rpartition(".")[0]
        pieces = [fp8_quantized(w, BLOCK) for w in experts]
        if fused:
            stored[name] = torch.stack([w for w, _ in pieces])
            stored[f"{name}_scale_inv"] = torch.stack([s for _, s in pieces])
            continue
        for e, expert in enumerate(experts):
            halves = expert.chunk(2) if name.endswith("gate_up_proj") else [expert]
            for proj, half in zip(
                ("gate_proj", "up_proj") if len(halves) == 2 else ("down_proj",), halves, strict=True
            ):
                weight, scale = fp8_quantized(half, BLOCK)
                stored[f"{prefix}.{e}.{proj}.weight"], stored[f"{prefix}.{e}.{proj}.weight_scale_inv"] = weight, scale
    save_file(stored, f"{directory}/model.safetensors")


@pytest.mark.parametrize(
    "family,fused,first",
    [
        ("deepseek_v3", False, "model.layers.1.mlp.experts.0.down_proj.weight_scale_inv"),  # layer 0 is dense
        ("qwen3_moe", True, "model.layers.0.mlp.experts.down_proj_scale_inv"),
    ],
)
def test_experts_stored_fp8_are_refused_by_name_before_any_rank_reads(tmp_path, family, fused, first):
    """Routed experts stored FP8 (DeepSeek-V3's files: each expert's projections; transformers' own: the stacked
    tensors) are not read yet: refused in one line naming the first, before any rank reads anything."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(getattr(configs, family)())
    fp8_checkpoint(model, tmp_path, BLOCK)
    _store_experts_fp8(tmp_path, fused)
    with pytest.raises(QuantizationError, match=rf"^{first} \(and \d+ more\) is stored fp8") as raised:
        autotp.from_pretrained(tmp_path)
    assert "\n" not in str(raised.value) and "experts stored quantized are not read" in str(raised.value)


def test_an_act_order_gptq_checkpoint_is_refused_before_any_rank_reads(tmp_path):
    """A g_idx that is not each input's index // group_size (GPTQ's act-order, here under a config that says
    desc_act false) is refused in one line naming the option, by from_pretrained and by autotp serve's check; the
    trivial g_idx the same checkpoint stored first passes that check."""
    from transformers import AutoModelForCausalLM

    from autotp.runtime.hf_checkpoint import Checkpoint
    from autotp.runtime.quantized import check_quantized, quantize_modules
    from autotp.serving.servable import check_servable
    from tests.helpers.serving import tokenizer

    model = AutoModelForCausalLM.from_config(configs.llama())
    gptq_checkpoint(model, tmp_path, GROUP)
    tokenizer(model.config.vocab_size).save_pretrained(tmp_path)
    check_quantized(Checkpoint(tmp_path), quantize_modules(model), quantization(model.config))
    stored = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.g_idx"
    stored[name] = stored[name][torch.randperm(len(stored[name]), generator=torch.Generator().manual_seed(0))]
    save_file(stored, tmp_path / "model.safetensors")
    for check in (autotp.from_pretrained, check_servable):
        with pytest.raises(QuantizationError, match=rf"{name} is not .* act-order \(desc_act true") as raised:
            check(tmp_path)
        assert "\n" not in str(raised.value)


def test_quantized_weights_are_frozen_and_pass_the_input_gradient():
    """Training a quantized model trains the rest: the quantized products pass the input's gradient through the
    dequantized weight; a quantized weight asked to train is refused in one line."""
    from autotp.passes.capture import check_inputs
    from autotp.runtime.quantized import quantize_modules

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 40))
    model.config = configs.llama(quantization_config={"quant_method": "fp8", "weight_block_size": [16, 16]})
    quantize_modules(model)
    layer = model[0]
    layer.weight.data, layer.weight_scale_inv.data = fp8_quantized(torch.randn(40, 48), (16, 16))
    x = torch.randn(3, 48, requires_grad=True)
    model(x).square().sum().backward()
    dense = fp8_dequantized(layer.weight, layer.weight_scale_inv, 16, 16).requires_grad_(False)
    y = x.detach().clone().requires_grad_(True)
    (torch.nn.functional.linear(y, dense) + layer.bias).square().sum().backward()
    assert torch.equal(x.grad, y.grad) and layer.weight.grad is None and layer.bias.grad is not None
    layer.weight.requires_grad_(True)
    with pytest.raises(TypeError, match=r"0.weight is stored quantized .* cannot be trained: freeze it"):
        check_inputs(model, (x,), None)


@pytest.mark.parametrize(
    "config,named",
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
        ({"quant_method": "compressed-tensors"}, "quant_method 'compressed-tensors'"),
        ({"quant_method": "fp8"}, "weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "'static'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act true"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits 8"),
    ],
)
def test_unsupported_quantization_is_refused_in_one_line(tmp_path, config, named):
    """Refused by from_pretrained before any rank reads anything (no process group needed to get the error)."""
    configs.llama(quantization_config=config).save_pretrained(tmp_path)
    with pytest.raises(QuantizationError, match=named) as raised:
        autotp.from_pretrained(tmp_path)
    assert "\n" not in str(raised.value)
    assert quantization(configs.llama()) is None


def _write(kind: str, directory: str, block: tuple[int, int] = BLOCK, **sizes) -> None:
    """A tiny LLaMA (by default 4 heads of 16, 2 KV heads, MLP of 13 blocks) as a quantized checkpoint, and beside it
    the full-precision model it stands for (``reference.pt``); ``lm_head`` left unquantized (modules_to_not_convert)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(configs.llama(**{"intermediate_size": 208, **sizes})).eval()
    if kind == "fp8":
        fp8_checkpoint(model, directory, block)
    else:
        gptq_checkpoint(model, directory, block[1])
    torch.save(model.state_dict(), f"{directory}/reference.pt")


def _reference(directory: str):
    """The full-precision model the checkpoint in ``directory`` stands for."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config).eval()
    model.load_state_dict(torch.load(f"{directory}/reference.pt"))
    return model


def _stored(kind: str) -> dict:
    """The tensors of one quantized linear: name suffix -> dtype."""
    if kind == "fp8":
        return {"weight": torch.float8_e4m3fn, "weight_scale_inv": torch.float32}
    return {"qweight": torch.int32, "scales": torch.float16, "qzeros": torch.int32}


def _serves_quantized(rank: int, world: int, kind: str, directory: str) -> None:
    from rich.console import Console

    from autotp.placement import parse
    from autotp.plan import Plan
    from autotp.runtime.hf_checkpoint import Checkpoint
    from autotp.tools.report import print_plan

    read: dict = {}
    original = Checkpoint._read_stored

    def recording(self, key, box):  # what this rank reads of each stored tensor
        piece = original(self, key, box)
        read[key] = read.get(key, 0) + piece.numel()
        return piece

    Checkpoint._read_stored = recording
    try:
        sharded = autotp.from_pretrained(directory, training=False)
    finally:
        Checkpoint._read_stored = original
    reference = _reference(directory)
    torch.manual_seed(1)
    ids = torch.randint(1, 96, (2, 7))  # no 0: transformers' generate would take it for padding
    torch.testing.assert_close(sharded(ids).logits, reference(ids).logits, **TOL)
    want = reference.generate(ids[:, :4], max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(autotp.generate(sharded, ids[:, :4], max_new_tokens=5, pad_token_id=0), want)
    plan = sharded.autotp_plan
    assert sums_per_block(plan) == {0: 2, 1: 2}, plan.collectives  # Megatron's count: 2 all-reduces a block
    # a rank holds the stored bytes and scales of its pieces only, split alike at whole blocks
    held = dict(sharded.named_parameters())
    stored = _stored(kind)
    for layer in ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj"):
        names = [f"model.layers.0.{layer}.{suffix}" for suffix in stored]
        for name, dtype in zip(names, stored.values(), strict=True):
            assert held[name].dtype == dtype and parse(plan.params[name]) != parse("R"), (name, plan.params[name])
            assert read[name] == held[name].numel() < torch.Size(plan.shapes[name]).numel(), name  # read: its piece
    assert not any(p.dtype == torch.float32 and "proj.weight" in n for n, p in held.items() if kind == "gptq")
    assert plan.params["model.layers.0.mlp.down_proj." + next(iter(stored))].endswith("/13)")  # 13 blocks, uneven
    # the plan records each stored tensor's format and blocks, autotp plan shows them, its memory counts their bytes
    first = next(iter(stored))
    assert plan.quantized[f"model.layers.1.mlp.down_proj.{first}"].startswith(
        "fp8 e4m3 in 16x16" if kind == "fp8" else "gptq int4"
    )
    assert len(plan.quantized) == 7 * 2 * len(stored) and Plan.from_json(plan.to_json()).quantized == plan.quantized
    console = Console(record=True, width=140)
    print_plan(plan, console=console)
    assert "stored quantized: 14 weights" in console.export_text()
    if rank == 0:  # the first ranks hold the larger pieces of uneven splits
        assert plan.cost["memory"]["params"] == sum(p.numel() * p.element_size() for p in sharded.parameters())
    if kind == "fp8":  # the engine's step program reads the same products either way
        _serves_greedily(sharded, reference, ids[:, :4], rank)
    saved = autotp.save_pretrained(sharded, f"{directory}/saved")
    if rank == 0:  # the same format back, every tensor name and bit
        original, written = load_file(f"{directory}/model.safetensors"), load_file(f"{saved}/model.safetensors")
        assert original.keys() == written.keys()
        for name, tensor in original.items():
            assert written[name].dtype == tensor.dtype and torch.equal(
                written[name].view(torch.uint8), tensor.view(torch.uint8)
            ), name
        assert json.loads((saved / "config.json").read_text())["quantization_config"]["quant_method"] == kind


def _serves_greedily(sharded, reference, prompts: torch.Tensor, rank: int) -> None:
    """The serving engine (what ``autotp serve`` runs) answers each prompt with the reference's greedy tokens."""
    import threading

    from autotp.serving.choices import Request, Sampling
    from autotp.serving.engine import Engine
    from tests.helpers.serving import tokenizer

    engine = Engine(
        sharded, tokenizer(96), blocks=8, block_size=4, max_num_seqs=2, max_batched_tokens=8, max_model_len=16
    )
    if rank != 0:
        engine.follow()
        return
    loop = threading.Thread(target=engine.run)
    loop.start()
    requests = [
        Request(p.tolist(), Sampling(max_tokens=4, temperature=0, ignore_eos=True), lambda r: None) for p in prompts
    ]
    for request in requests:
        engine.submit(request)
    while not all(r.finished for r in requests):
        time.sleep(0.01)
    engine.stop()
    loop.join()
    want = reference.generate(prompts, max_new_tokens=4, do_sample=False, pad_token_id=0)[:, prompts.shape[1] :]
    assert [r.choices[0].sequence.output for r in requests] == want.tolist()


@pytest.mark.parametrize("kind,world", [("fp8", 3), ("gptq", 4)])
def test_quantized_checkpoint_sharded_by_whole_blocks(tmp_path, kind, world):
    """Logits and greedy tokens equal the dequantized model's in one process (fp32), KV heads fewer than ranks at 3
    and 4, an MLP of 13 blocks split unevenly; each rank reads only its blocks and scales; saved back as read."""
    directory = str(tmp_path)
    _write(kind, directory)
    run_ranks(world, _serves_quantized, kind, directory, captures=functools.partial(_quantized_models, kind, directory))


def _quantized_models(kind: str, directory: str) -> list:
    from autotp.runtime.quantized import quantize_modules

    return [(quantize_modules(model), args) for model, args in pretrained_models(directory)]


RAGGED = {"hidden_size": 256, "intermediate_size": 200}  # blocks of 128: an MLP of one block and a ragged 72


def _exact_with_ragged_blocks(rank: int, world: int, directory: str) -> None:
    from autotp.placement import Shard, parse

    sharded = autotp.from_pretrained(directory, training=False)
    reference = _reference(directory)
    torch.manual_seed(1)
    ids = torch.randint(1, 96, (2, 7))
    torch.testing.assert_close(sharded(ids).logits, reference(ids).logits, **TOL)
    want = reference.generate(ids[:, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(autotp.generate(sharded, ids[:, :4], max_new_tokens=4, pad_token_id=0), want)
    plan = sharded.autotp_plan
    split = set()
    for name in (n for n, text in plan.quantized.items() if text.startswith("fp8")):
        placement, shape = parse(plan.params[name]), plan.shapes[name]
        if not isinstance(placement, Shard):
            continue
        size = shape[placement.dim]
        for r in range(world):  # every cut between whole blocks; the ragged last block whole on one rank
            for start, n in placement.ranges(size, r, world):
                assert start % 128 == 0 and ((start + n) % 128 == 0 or start + n == size), (name, placement, r)
        split.add((name.rpartition(".")[0].rpartition(".")[2], placement.dim))
    assert ("q_proj", 0) in split, split  # heads split by whole blocks beside the ragged MLP


@pytest.mark.slow
def test_a_ragged_last_block_is_never_cut(tmp_path):
    """FP8 in blocks of 128 on dims of 256 and 200 (one block and a ragged 72) at 2 ranks (50 s): logits and greedy
    tokens equal the dequantized model's; every quantized weight is cut only between whole blocks, so the ragged
    MLP dim is held whole (the MLP is split along its 256: gate and up by rows, down by columns)."""
    directory = str(tmp_path)
    _write("fp8", directory, (128, 128), **RAGGED)
    captures = functools.partial(_quantized_models, "fp8", directory)
    run_ranks(2, _exact_with_ragged_blocks, directory, captures=captures)


@pytest.mark.slow
@pytest.mark.parametrize("kind,world", [("fp8", 2), ("fp8", 4), ("gptq", 2), ("gptq", 3)])
def test_quantized_checkpoint_at_other_rank_counts(tmp_path, kind, world):
    test_quantized_checkpoint_sharded_by_whole_blocks(tmp_path, kind, world)


@pytest.mark.slow
def test_autotp_serve_answers_from_a_quantized_checkpoint(tmp_path):
    """``autotp serve`` on an FP8 checkpoint directory at 2 ranks, asked by the openai client: a completion's greedy
    tokens are those of transformers' generate on the dequantized model in one process."""
    openai = pytest.importorskip("openai")
    from transformers import AutoModelForCausalLM

    from tests.helpers.serving import Server, tokenizer

    config = configs.llama(
        intermediate_size=208,
        use_cache=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    fp8_checkpoint(model, tmp_path, BLOCK)  # the model is now the checkpoint dequantized
    words = tokenizer(config.vocab_size)
    words.save_pretrained(tmp_path)
    text = "w11 w42 w23 w64 w35"
    with Server(tmp_path, "--served-model-name", "fp8", "--kv-blocks", "8", "--block-size", "4", world=2) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        reply = client.completions.create(model="fp8", prompt=text, max_tokens=6, temperature=0, logprobs=1)
    served = [words.convert_tokens_to_ids(t) for t in reply.choices[0].logprobs.tokens]
    prompt = torch.tensor([words(text)["input_ids"]])
    want = model.generate(prompt, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert served == want[0, prompt.shape[1] :].tolist() and len(served) == 6
