"""Quantized checkpoints written by the tests (no downloads), and the full-precision models they stand for.

``fp8_checkpoint``: a model's linear weights stored as transformers' "fp8" format stores them (e4m3, one float32
``weight_scale_inv`` per block, which multiplies; ragged last blocks), the rest as they are.  The reference is the
same model with each weight dequantized by transformers' own code (``_dequantize_fp8_weight``): an independent
reading of the format."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import save_file

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def fp8_quantized(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale_inv per block): each block scaled so that its largest value is e4m3's largest."""
    bn, bk = block
    n, k = weight.shape
    scale = torch.empty(math.ceil(n / bn), math.ceil(k / bk))
    quantized = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            piece = weight[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].float()
            scale[i, j] = piece.abs().amax().clamp(min=1e-12) / FP8_MAX
            quantized[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (piece / scale[i, j]).to(torch.float8_e4m3fn)
    return quantized, scale


def quantized_linears(model: torch.nn.Module, keep: tuple[str, ...]) -> list[str]:
    """The names of the linear layers a checkpoint stores quantized: all but ``keep`` and tied ones."""
    tied = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n not in dict(model.named_parameters())}
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rpartition(".")[2] not in keep and id(m.weight) not in tied
    ]


def fp8_checkpoint(model, directory: Path, block: tuple[int, int], keep: tuple[str, ...] = ("lm_head",)):
    """Write ``model`` as an fp8 checkpoint in ``directory`` and turn ``model`` (in place) into the full-precision
    model it stands for: each quantized weight replaced by transformers' dequantization of it."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    model.config.quantization_config = {
        "quant_method": "fp8",
        "weight_block_size": list(block),
        "activation_scheme": "dynamic",
        "modules_to_not_convert": list(keep),
    }
    model.save_pretrained(directory)  # config, generation config and full-precision tensors
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for name in quantized_linears(model, keep):
            linear = model.get_submodule(name)
            quantized, scale = fp8_quantized(linear.weight, block)
            state[f"{name}.weight"], state[f"{name}.weight_scale_inv"] = quantized, scale
            linear.weight.copy_(_dequantize_fp8_weight(quantized, scale, list(block), torch.float32))
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, Path(directory) / "model.safetensors", metadata={"format": "pt"})
    return directory


def gptq_quantized(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values [K, N] in 0..15, zeros [K/g, N] in 1..15, float16 scales [K/g, N]) of a linear's weight [N, K]:
    asymmetric 4 bits per group of ``group`` inputs and per output (zeros kept at least 1: v1 stores them one less)."""
    w = weight.detach().float().T  # [K, N]
    grouped = w.unflatten(0, (-1, group))
    low, high = grouped.amin(1).clamp(max=0), grouped.amax(1).clamp(min=0)
    scales = ((high - low) / 14).clamp(min=1e-6).half()
    zeros = (1 - low / scales.float()).round().clamp(1, 15)
    values = (grouped / scales.float()[:, None] + zeros[:, None]).round().clamp(0, 15).flatten(0, 1)
    return values.to(torch.int32), zeros.to(torch.int32), scales


def gptq_dequantized(values: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """The weight [N, K] the values stand for: scale x (value - zero), by definition."""
    expand = lambda t: t.repeat_interleave(group, 0).float()  # noqa: E731
    return ((values.float() - expand(zeros)) * expand(scales)).T


def gptq_checkpoint(model, directory: Path, group: int, keep: tuple[str, ...] = ("lm_head",)):
    """Write ``model`` as a GPTQ (v1, desc_act false) int4 checkpoint and turn ``model`` (in place) into the
    full-precision model it stands for.  Packing by GPTQ's definition: 8 values a word along inputs (qweight),
    8 zeros a word along outputs (qzeros), each zero stored one less, value i at bits 4i."""
    model.config.quantization_config = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group,
        "desc_act": False,
        "sym": False,
        "checkpoint_format": "gptq",
        "modules_to_not_convert": list(keep),
    }
    model.save_pretrained(directory)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for name in quantized_linears(model, keep):
            linear = model.get_submodule(name)
            values, zeros, scales = gptq_quantized(linear.weight, group)
            del state[f"{name}.weight"]
            state[f"{name}.qweight"] = _packed(values.T).T.contiguous()
            state[f"{name}.qzeros"] = _packed(zeros - 1)
            state[f"{name}.scales"] = scales
            state[f"{name}.g_idx"] = torch.arange(values.shape[0], dtype=torch.int32) // group
            linear.weight.copy_(gptq_dequantized(values, zeros, scales, group))
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, Path(directory) / "model.safetensors", metadata={"format": "pt"})
    return directory


def _packed(values: torch.Tensor) -> torch.Tensor:
    """Words of 8 values along the last dim, value i at bits 4i (written out, not autotp's pack_int4)."""
    words = torch.zeros(*values.shape[:-1], values.shape[-1] // 8, dtype=torch.int64)
    for i in range(8):
        words |= (values[..., i::8].to(torch.int64) & 0xF) << (4 * i)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed
