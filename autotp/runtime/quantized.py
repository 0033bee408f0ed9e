"""Quantized checkpoints: the config's ``quantization_config`` read (or refused in one line), and the linear layers
whose weights are stored quantized replaced by modules that hold the stored tensors, under the stored names, and
call the quantized custom ops (runtime/quantized_ops.py).

A rank then holds only the quantized bytes and scales of its pieces: the plan splits them like any parameter, at
whole blocks, groups and packed words (ops/quantized_rules.py), and each rank reads its boxes of them from the
safetensors files (runtime/hf_checkpoint.py); ``save_pretrained`` gathers them back into the same format.  The
quantized tensors are frozen: a training plan trains the rest (biases, norms, embeddings, unquantized layers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from autotp.runtime import quantized_ops
from autotp.runtime.conversion import CheckpointError
from autotp.runtime.hf_checkpoint import Checkpoint


@dataclass(frozen=True)
class Quantization:
    """How a checkpoint's linear weights are stored: ``method`` "fp8" (``block``: (bn, bk) of the float32
    ``weight_scale_inv``) or "gptq" (4 bits, ``block``: (1, group size)); ``keep``: modules left unquantized."""

    method: str
    block: tuple[int, int]
    keep: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.method == "fp8":
            return f"fp8 e4m3, one float32 scale per {self.block[0]}x{self.block[1]} block"
        return f"gptq int4, one scale and zero per {self.block[1]} inputs, 8 values per int32 word"


class QuantizationError(CheckpointError):
    """A quantization format or option autotp does not read (raised before any rank loads anything)."""


def quantization(config) -> Quantization | None:
    """The quantization a transformers config declares, None for none; a format or option autotp does not read
    is refused in one line naming it."""
    found = getattr(config, "quantization_config", None)
    if found is None:
        return None
    found = found if isinstance(found, dict) else found.to_dict()
    method = found.get("quant_method")
    keep = tuple(found.get("modules_to_not_convert") or ())
    if method == "fp8":
        block = found.get("weight_block_size")
        if block is None or len(block) != 2:
            raise QuantizationError(
                "autotp reads fp8 checkpoints with weight_block_size [bn, bk] only (not per tensor)"
            )
        if found.get("activation_scheme", "dynamic") != "dynamic":  # static: a stored activation_scale a linear
            raise QuantizationError(
                f"autotp reads fp8 checkpoints of activation_scheme 'dynamic', not {found['activation_scheme']!r}"
            )
        if found.get("scale_fmt", "float") not in ("float", None):
            raise QuantizationError(f"autotp reads fp8 scales as float32, not scale_fmt {found['scale_fmt']!r}")
        return Quantization("fp8", (int(block[0]), int(block[1])), keep)
    if method == "gptq":
        bits, group = found.get("bits"), found.get("group_size")
        problems = [
            f"bits {bits} (4 only)" if bits != 4 else "",
            "desc_act true (false only)" if found.get("desc_act") else "",
            f"group_size {group} (a multiple of 8)" if not isinstance(group, int) or group <= 0 or group % 8 else "",
            "sym false with checkpoint_format other than gptq"
            if found.get("checkpoint_format", "gptq") != "gptq"
            else "",
        ]
        if any(problems):
            raise QuantizationError(f"autotp cannot read this gptq checkpoint: {', '.join(p for p in problems if p)}")
        return Quantization("gptq", (1, group), keep)
    raise QuantizationError(f"autotp does not read quant_method {method!r} checkpoints (it reads fp8 and gptq)")


def _frozen(shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class Fp8BlockLinear(nn.Module):
    """transformers' FP8 linear as stored: ``weight`` [N, K] e4m3 and ``weight_scale_inv`` per block."""

    def __init__(self, linear: nn.Linear, block: tuple[int, int]):
        super().__init__()
        n, k = linear.out_features, linear.in_features
        self.block = block
        self.weight = _frozen((n, k), torch.float8_e4m3fn)
        self.weight_scale_inv = _frozen((math.ceil(n / block[0]), math.ceil(k / block[1])), torch.float32)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.autotp.fp8_block_linear(x, self.weight, self.weight_scale_inv, *self.block)
        return y if self.bias is None else y + self.bias


class Int4GroupLinear(nn.Module):
    """GPTQ's int4 linear as stored: ``qweight`` [K/8, N], ``scales`` and ``qzeros`` [K/g, N/8] per group, ``g_idx``
    (each input's group: k // g, desc_act false, checked so by ``check_quantized`` and kept for saving); scales in
    float16, as GPTQ stores them."""

    def __init__(self, linear: nn.Linear, group: int):
        super().__init__()
        n, k = linear.out_features, linear.in_features
        if k % group or n % quantized_ops.PACK:
            raise QuantizationError(f"a gptq linear of {k} inputs and {n} outputs is not whole groups of {group}")
        self.group = group
        self.qweight = _frozen((k // quantized_ops.PACK, n), torch.int32)
        self.scales = _frozen((k // group, n), torch.float16)
        self.qzeros = _frozen((k // group, n // quantized_ops.PACK), torch.int32)
        self.register_buffer("g_idx", torch.empty(k, dtype=torch.int32))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.autotp.int4_group_linear(x, self.qweight, self.scales, self.qzeros, self.group)
        return y if self.bias is None else y + self.bias


def stored_quantized(model: nn.Module) -> frozenset[str]:
    """The names of the tensors ``model``'s quantized linears hold as stored (not their biases): the only tensors of
    a dtype autotp does not shard (FP8) that a capture accepts, read by the quantized products alone."""
    return frozenset(
        f"{path}.{name}" if path else name
        for path, module in model.named_modules()
        if isinstance(module, (Fp8BlockLinear, Int4GroupLinear))
        for name, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        if name != "bias"
    )


def quantize_modules(model: nn.Module, scheme: Quantization | None = None) -> nn.Module:
    """Replace (in place) every ``nn.Linear`` of ``model`` whose weight the checkpoint stores quantized by the module
    that holds it so, on the device of its weight (the meta device for ``from_pretrained``); a module named in
    ``modules_to_not_convert`` (or under one) stays as it is, and so do tied weights (an output layer tied to
    the embedding is stored once, unquantized)."""
    scheme = scheme or quantization(getattr(model, "config", None))
    if scheme is None:
        return model
    tied = _tied_ids(model)
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or id(module.weight) in tied or _kept(name, scheme.keep):
            continue
        with torch.device(module.weight.device):
            if scheme.method == "fp8":
                replaced: nn.Module = Fp8BlockLinear(module, scheme.block)
            else:
                replaced = Int4GroupLinear(module, scheme.block[1])
        owner_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner_name), attr, replaced)
    return model


def _kept(name: str, keep: tuple[str, ...]) -> bool:
    """transformers' rule: a name in the list, or under one of its entries, is left unquantized."""
    return any(name == k or name.endswith("." + k) or name.startswith(k + ".") or f".{k}." in name for k in keep)


def _tied_ids(model: nn.Module) -> set:
    seen: dict = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, v in seen.items() if v > 1}


# The names (last part) a format stores beside a quantized weight; stacked experts add them to the stacked
# tensor's name (transformers' FP8 experts: ``gate_up_proj_scale_inv``).
STORED = {"fp8": ("scale_inv",), "gptq": ("qweight", "qzeros", "scales", "g_idx")}


def check_quantized(checkpoint: Checkpoint, model: nn.Module, scheme: Quantization) -> None:
    """What the checkpoint stores quantized is what autotp reads, checked before any rank reads a piece: every
    quantized tensor belongs to a linear read so (one stored elsewhere, DeepSeek's FP8 experts or an embedding,
    is refused, named), and a GPTQ ``g_idx`` is each input's index // group size (desc_act false)."""
    held = {n for n, m in model.named_modules() if isinstance(m, (Fp8BlockLinear, Int4GroupLinear))}
    suffixes = STORED[scheme.method]
    names = checkpoint.stored
    other = sorted(n for n in names if _stored_beside(n, suffixes) and n.rpartition(".")[0] not in held)
    if other:
        raise QuantizationError(
            f"{other[0]}{f' (and {len(other) - 1} more)' if len(other) > 1 else ''} is stored {scheme.method}, but "
            "autotp reads quantized linear layers only (experts stored quantized are not read yet)"
        )
    for name in sorted(n for n in names if n.endswith(".g_idx")):
        _check_group_index(name, checkpoint.read_box(name, [slice(None)]), scheme.block[1])


def _stored_beside(name: str, suffixes: tuple[str, ...]) -> bool:
    last = name.rpartition(".")[2]
    return any(last == s or last.endswith("_" + s) for s in suffixes)


def _check_group_index(name: str, found: torch.Tensor, group: int) -> None:
    """desc_act false stores g_idx[i] = i // group_size; anything else is an act-order permutation of the inputs,
    which the products (and the splits by whole groups) do not read."""
    trivial = torch.arange(found.numel(), dtype=torch.int64) // group
    if found.dim() != 1 or not torch.equal(found.to(torch.int64), trivial):
        raise QuantizationError(
            f"{name} is not each input's index // group_size {group}: the checkpoint was quantized with act-order "
            "(desc_act true, whatever its config says), which autotp does not read: quantize it with desc_act false"
        )
