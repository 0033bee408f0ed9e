"""The op samples whose programs hold more than float64 parameters: a cache held as a constant, bfloat16 grouped
products, a complex rotary table, FP8 and int4 quantized weights.  ``TYPED_SAMPLES``: as op_samples.SAMPLES."""

from __future__ import annotations

import torch
from torch import nn

import autotp.runtime.quantized_ops  # noqa: F401  (registers torch.ops.autotp's quantized products)
from tests.helpers.op_samples import HEADS, D, H, Program, _floats


def complex_rotary(m, x):
    """A head's dims taken pairwise as complex numbers and turned by a complex table (complex rotary embeddings)."""
    b, s, _ = x.shape
    q = torch.nn.functional.linear(x, m.q).view(b, s, HEADS, 2 * D)
    pairs = torch.view_as_complex(q.reshape(b, s, HEADS, D, 2))
    turned = torch.view_as_real(pairs * m.table[:s].view(1, s, 1, D)).flatten(3)
    return turned.type_as(x) * x.view(b, s, HEADS, D).repeat(1, 1, 1, 2)


def grouped_bf16(m, x):
    return torch._grouped_mm(x, m.w, offs=torch.tensor([3, 5, 8], dtype=torch.int32))


def cache_write(m, x, positions):
    """A KV cache written in place at cache positions (generation's programs), and read back at some (a paged
    cache's block tables)."""
    m.cache.index_copy_(1, positions, x * m.w)
    return m.cache * 2 + m.cache.index_copy(1, positions, x) + m.cache.index_select(1, positions).sum(1, keepdim=True)


def _cache_program():
    program = Program(cache_write, w=(H,))
    program.cache = torch.zeros(2, 8, H, dtype=torch.float64)  # a plain tensor: captured as a constant
    return program


def _bf16_program():
    program = Program(grouped_bf16, w=(3, 16, 8))
    return program.to(torch.bfloat16)


def _complex_program():
    program = Program(complex_rotary, q=(2 * HEADS * D, H))
    angles = torch.outer(torch.arange(8, dtype=torch.float64), torch.arange(1, D + 1, dtype=torch.float64))
    program.register_buffer("table", torch.polar(torch.ones_like(angles), angles))  # complex128 [8, D]
    return program


def _fp8_linear(outputs: int, inputs: int) -> nn.Module:
    """An FP8 linear as a checkpoint stores it (runtime/quantized.Fp8BlockLinear), in blocks of 4 x 4."""
    from autotp.runtime.quantized import Fp8BlockLinear

    linear = Fp8BlockLinear(nn.Linear(inputs, outputs, bias=False), (4, 4))
    linear.weight.data = torch.randn(outputs, inputs).to(torch.float8_e4m3fn)
    linear.weight_scale_inv.data = torch.rand((outputs + 3) // 4, (inputs + 3) // 4) + 0.5
    return linear


class Quantized(nn.Module):
    """The quantized products (runtime/quantized_ops.py) on weights of 13 blocks, groups and packed words (uneven at
    2, 3 and 4 ranks), and one of ragged blocks (10 outputs in blocks of 4: never split inside one)."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.ragged = _fp8_linear(52, H), _fp8_linear(H, 52), _fp8_linear(10, H)
        words = torch.randint(-(2**31), 2**31 - 1, (13, 24), dtype=torch.int32)
        self.qweight = nn.Parameter(words, requires_grad=False)  # 104 inputs, 8 a word: 13 groups of 8
        self.scales = nn.Parameter((torch.rand(13, 24) / 8).half(), requires_grad=False)
        self.qzeros = nn.Parameter(torch.randint(0, 2**31 - 1, (13, 3), dtype=torch.int32), requires_grad=False)

    def forward(self, x, z):
        h = torch.nn.functional.silu(self.up(x))
        return self.ragged(self.down(h)), torch.ops.autotp.int4_group_linear(
            z, self.qweight, self.scales, self.qzeros, 8
        )


TYPED_SAMPLES = {
    "quantized": (Quantized, lambda: (_floats(2, 5, H), _floats(2, 5, 104))),
    "grouped_bf16": (_bf16_program, lambda: (torch.randn(8, 16, dtype=torch.bfloat16),)),
    "cache_write": (_cache_program, lambda: (_floats(2, 3, H), torch.tensor([1, 4, 6]))),
    "complex_rotary": (_complex_program, lambda: (_floats(2, 5, H),)),
}
