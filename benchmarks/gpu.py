"""The CUDA / NCCL path on one GPU, and the compute roofline the cost model assumes.

    python benchmarks/gpu.py [--out results.json] [--sections serve,two_ranks_gloo_cuda]

One GPU gives one NCCL rank, so this checks what a single GPU can: autotp's emitted program, the
safetensors shards and `torch.compile` on CUDA (exactness against the model itself, fp32, TF32 off),
greedy generation, and the cost model's compute figures against measured products (bf16 matrix
products at the per-rank shapes of TP-8 layouts; a whole TP-8 rank of a LLaMA-3-8B-shaped model, step
time measured against `plan.cost["seconds"]`; with ``--sections training``, benchmarks/gpu_training.py: a TP-8
rank's sequence-parallel slice compiled on a fake process group, its MFU and the fused ``symm_mem`` ops).
Multi-rank exactness is the gloo test suite's job.
Each section runs on its own: a failure is printed and the next section runs.  The card found sets the floors
(its profile's HBM bandwidth and bf16 peak: H100 3.35 TB/s, H200 4.8 TB/s).  gpu_ranks.py holds the sections with
more processes: ``autotp serve`` on NCCL, and two ranks on one GPU over gloo; gpu_serving.py the decode speed of
the serving path (CUDA graphs against the HBM floor and transformers' compiled generate); gpu_quantized.py quantized
checkpoints (exactness, weight-only products against bf16, PyTorch's FP8 and int4 kernels).  On a CPU every section
rehearses at tiny sizes (gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

RESULTS: dict = {}
CARDS = {"H100": "dgx-h100", "H200": "dgx-h200", "H800": "dgx-h800", "B200": "dgx-b200", "A100": "dgx-a100"}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only rehearses the script (gloo, tiny sizes)


def _timed(fn, warmup: int = 2, repeat: int = 10) -> float:
    """Median seconds of ``fn()`` between CUDA events."""
    for _ in range(warmup):
        fn()
    if DEVICE == "cpu":
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def card() -> str:
    """The topology profile of the GPU found (its figures have sources); dgx-h200's on a CPU or an unknown card."""
    name = torch.cuda.get_device_properties(0).name if DEVICE == "cuda" else ""
    return next((profile for key, profile in CARDS.items() if key in name), "dgx-h200")


def environment() -> dict:
    import transformers

    from autotp.cost_models import load_topology

    profile = load_topology(card())
    floors = {
        "profile": profile.name,
        "hbm_tb_s": profile.hbm_bandwidth / 1e12,
        "bf16_peak_tflops": profile.peak_flops / 1e12,
    }
    if DEVICE == "cpu":
        return {"torch": torch.__version__, "transformers": transformers.__version__, "gpu": None, **floors}
    props = torch.cuda.get_device_properties(0)
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "transformers": transformers.__version__,
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "python": sys.version.split()[0],
        **floors,
    }


# (M tokens, K, N): per-rank products of TP-8 layouts at 4096 tokens; Mixtral's experts see 4096 x 2 / 8 tokens each
PRODUCTS = {
    "square 8192^3": (8192, 8192, 8192),
    "llama3-70b tp8 qkv": (4096, 8192, 1280),
    "llama3-70b tp8 o": (4096, 1024, 8192),
    "llama3-70b tp8 gate+up": (4096, 8192, 7168),
    "llama3-70b tp8 down": (4096, 3584, 8192),
    "mixtral expert-TP8 gate+up": (1024, 4096, 3584),
    "mixtral expert-TP8 down": (1024, 1792, 4096),
    "mixtral whole-expert gate+up": (1024, 4096, 28672),
    "mixtral whole-expert down": (1024, 14336, 4096),
}


def matmuls() -> dict:
    """bf16 products: achieved TFLOP/s and share of the profile's peak, beside the share its product table predicts
    (cost_models/compute.py)."""
    from autotp.cost_models import load_topology
    from autotp.cost_models.compute import product_fraction

    topology = load_topology(card())
    out = {"profile_peak_tflops": topology.peak_flops / 1e12}
    for name, (m, k, n) in PRODUCTS.items():
        a = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=DEVICE, dtype=torch.bfloat16)
        seconds = _timed(lambda a=a, b=b: a @ b, warmup=3, repeat=20)
        achieved = 2 * m * k * n / seconds
        out[name] = {
            "ms": round(seconds * 1e3, 4),
            "tflops": round(achieved / 1e12, 1),
            "of_peak": round(achieved / topology.peak_flops, 3),
            "predicted": round(product_fraction(m, n, k, topology), 3),
        }
        print(
            f"  {name:32s} {out[name]['tflops']:7.1f} TFLOP/s  {out[name]['of_peak']:.2f} of peak "
            f"(table predicts {out[name]['predicted']:.2f})",
            flush=True,
        )
    return out


def _init_process_group() -> None:
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if DEVICE == "cpu":
        dist.init_process_group("gloo")
        return
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).to(DEVICE).eval()


def _device_name() -> str:
    return "cuda:0" if DEVICE == "cuda" else "cpu"


def max_diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def exactness() -> dict:
    """autotp's program on CUDA against the model: logits (3x11, 1x1), gradients, loading, compile, generation."""
    import autotp

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = tiny_llama()
    ids = torch.randint(0, 128, (3, 11), device=DEVICE)
    sharded = autotp.parallelize(model, (ids,))
    devices = sorted({str(p.device) for p in sharded.parameters()})
    out = {"parameter_devices": devices}
    for shape in ((3, 11), (1, 1)):
        x = torch.randint(0, 128, shape, device=DEVICE)
        with torch.no_grad():
            out[f"logits {shape[0]}x{shape[1]}"] = max_diff(sharded(x).logits, model(x).logits)
    sharded(ids).logits.pow(2).mean().backward()
    model(ids).logits.pow(2).mean().backward()
    grads = autotp.full_state_dict(sharded, grads=True)
    out["grads"] = max(max_diff(grads[name], p.grad) for name, p in model.named_parameters() if name in grads)
    model.zero_grad()

    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        loaded = autotp.from_pretrained(directory)
        out["loaded_devices"] = sorted({str(p.device) for p in loaded.parameters()})
        with torch.no_grad():
            out["loaded logits"] = max_diff(loaded(ids).logits, model(ids).logits)
        prompt = ids[:1, :5]
        mine = autotp.generate(loaded, prompt, max_new_tokens=8, eos_token_id=[])
        theirs = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
        out["generate_equal"] = bool(torch.equal(mine, theirs))

    compiled = torch.compile(sharded)
    with torch.no_grad():
        out["compiled logits"] = max_diff(compiled(ids).logits, model(ids).logits)
    compiled(ids).logits.pow(2).mean().backward()
    out["compiled_backward"] = "ran"
    ok = max(v for k, v in out.items() if isinstance(v, float)) < 1e-4 and out["generate_equal"]
    out["exact"] = bool(ok and {devices[0], out["loaded_devices"][0]} == {_device_name()})
    print("  ", out, flush=True)
    return out


def moe() -> dict:
    """A tiny Mixtral through autotp on CUDA, fp32 and bf16 (bf16 takes torch's own grouped_mm kernel on Hopper):
    logits (the plan's strategy and whole experts imposed) and gradients against the model, greedy generation."""
    from transformers import MixtralConfig, MixtralForCausalLM

    import autotp

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        config = MixtralConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            experts_implementation="grouped_mm",
        )
        model = MixtralForCausalLM(config).to(DEVICE, dtype).eval()
        ids = torch.randint(0, 128, (3, 11), device=DEVICE)
        sharded = autotp.parallelize(model, (ids,), check_inputs=False)
        whole = autotp.parallelize(model, (ids,), check_inputs=False, experts="parallel")  # the rank's own experts
        with torch.no_grad():
            logits = max(
                max_diff(sharded(ids).logits, model(ids).logits), max_diff(whole(ids).logits, model(ids).logits)
            )
        sharded(ids).logits.float().pow(2).mean().backward()
        model(ids).logits.float().pow(2).mean().backward()
        grads = autotp.full_state_dict(sharded, grads=True)
        grad = max(max_diff(grads[n], p.grad) for n, p in model.named_parameters() if n in grads)
        prompt = ids[:1, :5]
        same = torch.equal(
            autotp.generate(sharded, prompt, max_new_tokens=6, eos_token_id=[]),
            model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0),
        )
        ops = sorted({str(n.target) for n in sharded.graph.nodes if "grouped_mm" in str(n.target)})
        out[str(dtype)] = {"logits": logits, "grads": grad, "generate_equal": same, "expert_ops": ops}
    fp32 = out[str(torch.float32)]
    out["exact"] = bool(max(fp32["logits"], fp32["grads"]) < 1e-4 and all(v["generate_equal"] for v in out.values()))
    print("  ", out, flush=True)
    return out


def roofline(seq: int = 4096, layers: int = 4, hidden: int = 4096) -> dict:
    """One TP-8 rank of a LLaMA-3-8B-shaped model (4 of 32 heads, 1 of 8 KV heads, 1792 of 14336 FFN columns,
    1/8 of the vocabulary), bf16, one sequence: measured training step against the plan's estimate."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import autotp

    config = LlamaConfig(
        vocab_size=16032,
        hidden_size=hidden,
        intermediate_size=1792,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=128,
        max_position_embeddings=seq,
        torch_dtype="bfloat16",
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).to(DEVICE, torch.bfloat16).train()
    ids = torch.randint(0, config.vocab_size, (1, seq), device=DEVICE)
    sharded = autotp.parallelize(model, (ids,), topology=card(), check_inputs=False)
    estimate = sharded.autotp_plan.cost["seconds"]
    linear = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
    flops = 6 * seq * linear + 6 * 2 * layers * seq * seq * 4 * 128  # products, attention counted unmasked

    def step(module):
        def run():
            module(ids).logits.float().mean().backward()

        return run

    out = {"tokens": seq, "layers": layers, "estimate_s": estimate, "model_flops": flops}
    for name, module in (
        ("hf eager", model),
        ("autotp eager", sharded),
        ("hf compiled", torch.compile(model)),
        ("autotp compiled", torch.compile(sharded)),
    ):
        start = time.perf_counter()
        seconds = _timed(step(module), warmup=2, repeat=5)
        out[name] = {
            "s": round(seconds, 5),
            "vs_estimate": round(seconds / estimate, 3),
            "tflops": round(flops / seconds / 1e12, 1),
            "warmup_and_timing_s": round(time.perf_counter() - start, 1),
        }
        print(
            f"  {name:16s} {seconds * 1e3:8.2f} ms  {out[name]['vs_estimate']:.2f} x estimate "
            f"({estimate * 1e3:.2f} ms)  {out[name]['tflops']} TFLOP/s",
            flush=True,
        )
    return out


def experts(
    tokens: int = 4096, hidden: int = 4096, ffn: int = 14336, count: int = 8, top: int = 2, tp: int = 8
) -> dict:
    """One rank's MoE layer of a Mixtral-8x7B shape at TP 8 (transformers' grouped_mm experts, bf16, forward +
    backward): expert TP (every expert, 1/tp of its FFN dim, all tokens) against expert parallelism (one whole
    expert, the tokens routed to it: tokens x top / count).  The collective after it is the same all-reduce."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    def layer(experts_here: int, top_k: int, width: int, rows: int) -> float:
        config = MixtralConfig(
            hidden_size=hidden,
            intermediate_size=width,
            num_local_experts=experts_here,
            num_experts_per_tok=top_k,
            experts_implementation="grouped_mm",
        )
        block = MixtralSparseMoeBlock(config).to(DEVICE, torch.bfloat16)
        x = torch.randn(1, rows, hidden, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        return _timed(lambda: block(x).float().mean().backward(), warmup=3, repeat=10)

    tensor = layer(count, top, ffn // tp, tokens)
    whole = layer(1, 1, ffn, tokens * top // count)
    flops = 6 * 3 * tokens * top * hidden * ffn / tp  # gate, up, down: forward + backward, this rank's share
    out = {
        "expert_tp_ms": round(tensor * 1e3, 3),
        "expert_parallel_ms": round(whole * 1e3, 3),
        "expert_tp_tflops": round(flops / tensor / 1e12, 1),
        "expert_parallel_tflops": round(flops / whole / 1e12, 1),
    }
    print("  ", out, flush=True)
    return out


LOCAL = ("environment", "matmuls", "exactness", "moe", "roofline", "experts")


def main() -> None:
    import gpu_quantized
    import gpu_ranks
    import gpu_serving
    import gpu_training

    sections = {
        **{name: globals()[name] for name in LOCAL},
        "serve": gpu_ranks.serve,
        "two_ranks_gloo_cuda": gpu_ranks.two_ranks_gloo_cuda,
        "serving": gpu_serving.serving,
        "training": gpu_training.training,
        "quantized": gpu_quantized.quantized,
    }
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--sections", default=",".join(sections), help="comma-separated, from " + ", ".join(sections))
    parser.add_argument("--sizes", default="{}", help='section -> sizes, e.g. {"roofline": {"seq": 128}} to rehearse')
    args = parser.parse_args()
    for name in args.sections.split(","):
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        try:
            if (
                name in ("exactness", "moe", "roofline", "serving", "quantized")
                and not torch.distributed.is_initialized()
            ):
                _init_process_group()
            RESULTS[name] = sections[name](**json.loads(args.sizes).get(name, {}))
        except Exception:
            RESULTS[name] = {"error": traceback.format_exc()[-3000:]}
            print(RESULTS[name]["error"], flush=True)
        print(f"   ({time.perf_counter() - start:.1f} s)", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(RESULTS, indent=1, default=str))
    print(json.dumps(RESULTS.get("environment", {})))
    failed = [
        name
        for name, result in RESULTS.items()
        if "error" in result or False in (result.get("exact"), result.get("equal"))
    ]
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
