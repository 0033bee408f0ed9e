"""Quantized checkpoints on one GPU (``python benchmarks/gpu.py --sections quantized``, under 5 minutes on an H100).

1. exactness: an FP8 (blocks of 128 on the GPU) and a GPTQ int4 checkpoint written here, loaded by
   ``autotp.from_pretrained`` on the device: logits against the checkpoint dequantized into a full-precision model
   on the same device (TF32 off), and greedy tokens;
2. speed: a decode-shaped product (8 tokens, a LLaMA-3-8B MLP: 4096 -> 14336) by autotp's weight-only products
   against bf16 ``F.linear``, and the HBM floor of reading each one's weight bytes;
3. the kernels PyTorch has, to wire in next: ``F.scaled_mm`` block-wise (1x128 activations, 128x128 weights) and
   ``_weight_int4pack_mm`` with GPTQ's integer zeros converted to float zero points, each against the weight-only
   product, with the reason where one does not run.
On a CPU it rehearses at tiny sizes (blocks of 32, the least group the int4 kernels take): the int4 kernel is
PyTorch's CPU twin (``_weight_int4pack_mm_for_cpu``, the same (q - 8) x scale + zero), which checks the conversion of
GPTQ's zeros, and the block-wise ``scaled_mm`` call is checked at the GPU's sizes on the meta device, which checks
the scales' layout (the CUDA kernel's own checks), not its numbers.
"""

from __future__ import annotations

import tempfile

import torch
from gpu import DEVICE, _timed, max_diff


def quantized(hidden: int = 4096, ffn: int = 14336, tokens: int = 8) -> dict:
    out = {"exactness": _exactness(), **_speed(hidden, ffn, tokens)}
    out.update(_kernels(hidden, ffn, tokens))
    out["exact"] = bool(out["exactness"]["fp8_logits"] < 1e-4 and out["exactness"]["gptq_logits"] < 1e-4)
    out["exact"] &= out["exactness"]["fp8_tokens_equal"] and out["exactness"]["gptq_tokens_equal"]
    if DEVICE == "cpu":  # the rehearsal's own checks of the GPU's calls: the scales' layout, GPTQ's zeros converted
        out["exact"] &= out["scaled_mm_blockwise_layout"].startswith("accepted")
        out["exact"] &= out.get("int4pack_mm_relative", 1.0) < 0.02  # bf16 rounding; an off-by-one zero: ~0.1
    print("  ", out, flush=True)
    return out


def _exactness() -> dict:
    from transformers import AutoModelForCausalLM

    import autotp
    from tests.helpers import configs
    from tests.helpers.quantized import fp8_checkpoint, gptq_checkpoint

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    block = 128 if DEVICE == "cuda" else 16
    sizes = {"hidden_size": 2 * block, "intermediate_size": 5 * block, "num_attention_heads": 4, "vocab_size": 128}
    found = {}
    for kind, write in (("fp8", fp8_checkpoint), ("gptq", gptq_checkpoint)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(configs.llama(**sizes, num_key_value_heads=2)).eval()
        with tempfile.TemporaryDirectory() as directory:
            write(model, directory, (block, block) if kind == "fp8" else block)
            sharded = autotp.from_pretrained(directory, training=False)
        model = model.to(DEVICE)
        ids = torch.randint(1, 128, (3, 11), device=DEVICE)
        with torch.no_grad():
            found[f"{kind}_logits"] = max_diff(sharded(ids).logits, model(ids).logits)
        mine = autotp.generate(sharded, ids[:1, :5], max_new_tokens=8, pad_token_id=0)
        theirs = model.generate(ids[:1, :5], max_new_tokens=8, do_sample=False, pad_token_id=0)
        found[f"{kind}_tokens_equal"] = bool(torch.equal(mine, theirs))
        found[f"{kind}_devices"] = sorted({str(p.device) for p in sharded.parameters()})
    return found


def _operands(hidden: int, ffn: int, tokens: int, device: str = DEVICE) -> dict:
    from autotp.runtime.quantized_ops import PACK

    block = 128 if device != "cpu" else 32
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    weight = torch.randn(ffn, hidden, device=device).to(torch.float8_e4m3fn)
    scale = torch.rand(ffn // block, hidden // block, device=device) / 64
    words = torch.randint(-(2**31), 2**31 - 1, (hidden // PACK, ffn), device=device, dtype=torch.int32)
    scales = (torch.rand(hidden // block, ffn, device=device) / 64).half()
    zeros = torch.randint(-(2**31), 2**31 - 1, (hidden // block, ffn // PACK), device=device, dtype=torch.int32)
    return {"x": x, "fp8": (weight, scale, block, block), "int4": (words, scales, zeros, block), "block": block}


def _speed(hidden: int, ffn: int, tokens: int) -> dict:
    """Milliseconds of one product at a decode shape, and the HBM floor of its weight bytes (CUDA only)."""
    hidden, ffn = (hidden, ffn) if DEVICE == "cuda" else (128, 224)
    ops = _operands(hidden, ffn, tokens)
    x, dense = ops["x"], torch.randn(ffn, hidden, device=DEVICE, dtype=torch.bfloat16)
    times = {
        "bf16_ms": _timed(lambda: torch.nn.functional.linear(x, dense)),
        "fp8_weight_only_ms": _timed(lambda: torch.ops.autotp.fp8_block_linear(x, *ops["fp8"])),
        "int4_weight_only_ms": _timed(lambda: torch.ops.autotp.int4_group_linear(x, *ops["int4"])),
    }
    found = {k: round(v * 1e3, 4) for k, v in times.items()}
    if DEVICE == "cuda":
        bandwidth = 4.8e12 if "H200" in torch.cuda.get_device_name() else 3.35e12
        for name, nbytes in (("bf16", 2), ("fp8", 1), ("int4", 0.5)):
            found[f"{name}_floor_ms"] = round(ffn * hidden * nbytes / bandwidth * 1e3, 4)
    return found


def _kernels(hidden: int, ffn: int, tokens: int) -> dict:
    """PyTorch's own quantized kernels against the weight-only products (relative max difference), or why not."""
    ops = _operands(*((hidden, ffn) if DEVICE == "cuda" else (128, 224)), tokens)
    found = {}
    for name, run in (("scaled_mm_blockwise", _scaled_mm), ("int4pack_mm", _int4pack)):
        try:
            got, want = run(ops)
            found[f"{name}_relative"] = max_diff(got, want) / float(want.float().abs().max())
        except Exception as exc:  # the kernel's own reason (a CPU build, an older card, a layout it wants)
            found[f"{name}_not_run"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    if DEVICE == "cpu":  # the block-wise call as the GPU makes it, its layout checked by PyTorch's meta kernel
        try:
            _scaled_mm(_operands(hidden, ffn, tokens, device="meta"), compare=False)
            found["scaled_mm_blockwise_layout"] = f"accepted at {tokens}x{hidden}x{ffn} (meta)"
        except Exception as exc:
            found["scaled_mm_blockwise_layout"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    return found


def _scaled_mm(ops: dict, compare: bool = True) -> tuple:
    """FP8 activations scaled per token and 128 inputs (max-abs, dynamic), weights per 128x128 block.  The kernel
    reads activation scales [M, K/128] column-major and the weight's scales as [K/128 rounded up to 4, N/128]
    column-major: transformers' ``weight_scale_inv`` [N/128, K/128], its columns padded to a multiple of 4,
    transposed (no copy)."""
    import torch.nn.functional as F

    from autotp.runtime.quantized_ops import fp8_dequantized

    x, (weight, scale, bn, bk) = ops["x"], ops["fp8"]
    pieces = x.float().unflatten(-1, (-1, bk))
    x_scale = pieces.abs().amax(-1).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    x_fp8 = (pieces / x_scale[..., None]).to(torch.float8_e4m3fn).flatten(-2)
    padded = torch.nn.functional.pad(scale, (0, -scale.shape[1] % 4))
    got = F.scaled_mm(
        x_fp8,
        weight.t(),
        x_scale.t().contiguous().t(),
        F.ScalingType.BlockWise1x128,
        padded.t(),
        F.ScalingType.BlockWise128x128,
        output_dtype=torch.bfloat16,
    )
    if not compare:
        return got, None
    x_back = (x_fp8.float().unflatten(-1, (-1, bk)) * x_scale[..., None]).flatten(-2)
    return got, x_back @ fp8_dequantized(weight, scale, bn, bk).t()


def _int4pack(ops: dict) -> tuple:
    """GPTQ's w = s (q - z) as tinygemm's w = (q - 8) s + m: m = s (8 - z), z = stored zero + 1; packed as PyTorch's
    own tests pack for CUDA (two values a byte, the even input high), or for its CPU twin (the int32 values)."""
    from autotp.runtime.quantized_ops import unpack_int4

    x, (words, scales, zeros, group) = ops["x"], ops["int4"]
    values = unpack_int4(words, 0).t().contiguous()  # [N, K] in 0..15
    z = unpack_int4(zeros, 1).float() + 1
    both = torch.stack([scales.float(), scales.float() * (8 - z)], -1).to(torch.bfloat16)  # [K/g, N, 2]
    if x.device.type == "cpu":
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 8)
        got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, both)
    else:
        nibbles = (values[:, ::2] << 4 | values[:, 1::2]).to(torch.uint8)
        got = torch.ops.aten._weight_int4pack_mm(x, torch.ops.aten._convert_weight_to_int4pack(nibbles, 8), group, both)
    return got, torch.ops.autotp.int4_group_linear(x, words, scales, zeros, group)
