"""The quantized products as custom ops (``torch.ops.autotp``), so that a capture sees a quantized linear as one op
with its own op-table row (ops/quantized_rules.py), never transformers' kernels or the dequantization's ops.

Weight-only semantics, the same on every rank and in one process: each call dequantizes the weight piece it is given
in float32 (the scale multiplies), casts it to the activation's dtype and multiplies.  A piece cut at whole blocks,
groups and packed words is a quantized weight of its own (its scales and zeros cut alike), so the sharded op is the
same op on smaller tensors.

  fp8_block_linear(x, weight[N, K] e4m3, scale_inv[ceil(N/bn), ceil(K/bk)] f32, bn, bk)   transformers' "fp8"
  int4_group_linear(x, qweight[K/8, N] i32, scales[K/g, N], qzeros[K/g, N/8] i32, g)      GPTQ v1, desc_act false
"""

from __future__ import annotations

import torch

PACK = 8  # int4 values in one int32 word (GPTQ packs them low bits first)


def fp8_dequantized(weight: torch.Tensor, scale_inv: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """The float32 weight: each (block_n x block_k) block times its scale; the last blocks may be ragged."""
    n, k = weight.shape
    scale = scale_inv.float().repeat_interleave(block_n, 0)[:n].repeat_interleave(block_k, 1)[:, :k]
    return weight.float() * scale


def unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """The 4-bit values of int32 words along ``dim``, value i of a word at bits 4i..4i+3 (GPTQ's packing)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    moved = packed.movedim(dim, -1)
    values = (moved.unsqueeze(-1) >> shifts) & 0xF
    return values.flatten(-2).movedim(-1, dim)


def pack_int4(values: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of ``unpack_int4``: 8 values in 0..15 along ``dim`` into one int32 word each."""
    moved = values.to(torch.int64).movedim(dim, -1)
    words = moved.unflatten(-1, (-1, PACK)) << torch.arange(0, 32, 4, device=values.device)
    packed = words.sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).movedim(-1, dim)


def int4_dequantized(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, group: int) -> torch.Tensor:
    """The float32 weight [K, N]: scale x (value - zero) per group of ``group`` inputs; GPTQ v1 stores each zero
    one less than it is."""
    values = unpack_int4(qweight, 0).float()
    zeros = unpack_int4(qzeros, 1).float() + 1
    return (values - zeros.repeat_interleave(group, 0)) * scales.float().repeat_interleave(group, 0)


@torch.library.custom_op("autotp::fp8_block_linear", mutates_args=())
def fp8_block_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block_n: int, block_k: int
) -> torch.Tensor:
    return torch.nn.functional.linear(x, fp8_dequantized(weight, scale_inv, block_n, block_k).to(x.dtype))


@fp8_block_linear.register_fake
def _(x, weight, scale_inv, block_n, block_k):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("autotp::int4_group_linear", mutates_args=())
def int4_group_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, group: int
) -> torch.Tensor:
    return x @ int4_dequantized(qweight, scales, qzeros, group).to(x.dtype)


@int4_group_linear.register_fake
def _(x, qweight, scales, qzeros, group):
    return x.new_empty(*x.shape[:-1], qweight.shape[1])


def _fp8_backward(ctx, grad):
    """The input's gradient through the dequantized weight; the quantized weight is frozen (no gradient)."""
    weight, scale_inv = ctx.saved
    return grad @ fp8_dequantized(weight, scale_inv, *ctx.blocks).to(grad.dtype), None, None, None, None


def _fp8_keep(ctx, inputs, output):
    ctx.saved, ctx.blocks = inputs[1:3], inputs[3:5]


def _int4_backward(ctx, grad):
    qweight, scales, qzeros, group = ctx.saved
    return grad @ int4_dequantized(qweight, scales, qzeros, group).to(grad.dtype).T, None, None, None, None


def _int4_keep(ctx, inputs, output):
    ctx.saved = inputs[1:5]


fp8_block_linear.register_autograd(_fp8_backward, setup_context=_fp8_keep)
int4_group_linear.register_autograd(_int4_backward, setup_context=_int4_keep)
