"""What the cost model says of quantized products: a fused weight-only kernel reading the stored bytes and
dequantizing on the CUDA cores (cost_models/compute.py), one product and a serve plan, priced on the meta device."""

from __future__ import annotations

import pytest
import torch

import autotp
from tests.helpers import configs


def _priced(kind: str, rows: int) -> float:
    """Seconds of one product x[rows, 8192] @ W[8192 -> 28672] (a LLaMA-3-70B MLP's gate) on one H100, inference,
    its weight stored as ``kind`` (bf16, fp8 in 128x128 blocks, gptq int4 in groups of 128)."""
    from autotp.runtime.quantized import Fp8BlockLinear, Int4GroupLinear

    with torch.device("meta"):
        layer = torch.nn.Linear(8192, 28672, bias=False, dtype=torch.bfloat16)
        stored = {"bf16": layer, "fp8": Fp8BlockLinear(layer, (128, 128)), "gptq": Int4GroupLinear(layer, 128)}[kind]
    x = torch.zeros(rows, 8192, dtype=torch.bfloat16, device="meta")
    plan = autotp.plan(torch.nn.Sequential(stored), (x,), world_size=1, topology="dgx-h100", training=False)
    return plan.cost["seconds"]


def test_quantized_products_read_their_stored_bytes_and_pay_their_dequantization():
    """Decode (8 rows, memory-bound): the weight read halves in FP8 and quarters in int4, the dequantization hidden
    behind it.  Prefill (4096 rows, compute-bound): the product's arithmetic plus the dequantization, each weight
    element dequantized once per 128 rows on the CUDA cores (67 TFLOP/s fp32, the H100 datasheet), at the
    operations the dequantization takes (fp8: to float, times the scale, to bf16; int4 three more)."""
    bf16, fp8, gptq = (_priced(kind, 8) for kind in ("bf16", "fp8", "gptq"))
    assert fp8 / bf16 == pytest.approx(0.5, abs=0.02) and gptq / bf16 == pytest.approx(0.25, abs=0.03)
    print(f"decode, 8 rows: bf16 {bf16 * 1e6:.1f} us, fp8 {fp8 * 1e6:.1f} us, int4 {gptq * 1e6:.1f} us")
    weight = 28672 * 8192
    dequantized = {kind: ops * weight * (4096 / 128) / 67e12 for kind, ops in (("fp8", 3), ("gptq", 6))}
    dense = _priced("bf16", 4096)
    for kind in ("fp8", "gptq"):
        assert _priced(kind, 4096) - dense == pytest.approx(dequantized[kind], rel=0.02), kind


def _serve_plan(quantized: bool):
    """``autotp serve``'s plan (one H100, a context of 4096, 8 sequences) of two LLaMA-3-8B-shaped blocks, bf16 or
    stored FP8 in blocks of 128 (lm_head unquantized), built on the meta device."""
    from transformers import AutoModelForCausalLM

    from autotp.runtime.quantized import quantize_modules
    from autotp.serving.serve_plan import plan_serving

    config = configs.llama(**LLAMA_3_8B, num_hidden_layers=2, max_position_embeddings=8192)
    if quantized:
        config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
        config.quantization_config["modules_to_not_convert"] = ["lm_head"]
    with torch.device("meta"):
        model = quantize_modules(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16))
    return plan_serving(model, world_size=1, context=4096, max_batch=8, topology="dgx-h100")


LLAMA_3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
}


@pytest.mark.slow
def test_an_fp8_serve_plan_halves_the_linears_bytes_and_keeps_the_kv_cache():
    """The serve plan of an FP8 checkpoint (35 s): the KV cache per sequence as large as bf16's, the linears' bytes
    halved (their scales added: one float32 per 128x128 block, counted here from the shapes), a decode step faster
    for it and a prefill slower by its dequantization."""
    dense, fp8 = _serve_plan(False), _serve_plan(True)
    assert fp8.kv_bytes_per_sequence == dense.kv_bytes_per_sequence > 0
    h, f, kv = 4096, 14336, 1024
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]  # q, k, v, o, gate, up, down: [out, in]
    halved = sum(n * k - 4 * -(-n // 128) * -(-k // 128) for n, k in shapes) * 2  # 2 bf16 bytes -> 1, + scales
    assert dense.decode.cost["memory"]["params"] - fp8.decode.cost["memory"]["params"] == halved
    assert fp8.decode_seconds < dense.decode_seconds and fp8.prefill_seconds_per_1000 > dense.prefill_seconds_per_1000
