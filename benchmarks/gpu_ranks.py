"""benchmarks/gpu.py's sections with more than one process or a server: the paths a single NCCL rank alone does
not show.

  serve                 ``autotp serve`` at world size 1 (NCCL on a GPU: its engine's host messages go over a CPU
                        group of their own) answering a chat completion from the ``openai`` client, for an 8-layer
                        LLaMA with random weights written here; the answer is transformers' greedy one.
  two_ranks_gloo_cuda   two processes on one GPU over gloo with CUDA tensors (NCCL refuses two ranks on one GPU):
                        ``parallelize``, a DeviceMesh with FSDP2 (examples/train.py, 3 steps) and ``autotp.generate``,
                        every shard and KV cache on the GPU, outputs and gradients equal to one process.

On a CPU both rehearse at tiny sizes over gloo (tests/test_benchmarks.py runs them).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from gpu import DEVICE, max_diff, tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def serve(layers: int = 8, hidden: int = 256, tokens: int = 12) -> dict:
    import openai

    from tests.helpers.serving import Server, save_model, tokenizer

    with tempfile.TemporaryDirectory() as directory:
        model = save_model(
            Path(directory),
            num_hidden_layers=layers,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=512,
        )
        messages = [{"role": "user", "content": "w10 w11 w12 w13"}]
        words = tokenizer(model.config.vocab_size)
        ids = words.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        with Server(Path(directory), "--max-model-len", "64", world=1) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
            answer = client.chat.completions.create(
                model=Path(directory).name,
                messages=messages,
                max_tokens=tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
    model = model.to(DEVICE)
    with torch.no_grad():
        greedy = model.generate(
            torch.tensor([ids], device=DEVICE),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
        )
    text = words.decode(greedy[0, len(ids) :].tolist(), skip_special_tokens=True)
    served = answer.choices[0].message.content
    out = {
        "group": "nccl" if DEVICE == "cuda" else "gloo",
        "answer": served,
        "transformers": text,
        "equal": served == text,
    }
    print("  ", out, flush=True)
    return out


def _on_one_gpu(rank: int, world: int) -> dict:
    """One of two ranks over gloo, CUDA tensors: TP 2 against the model, then FSDP2 over 2 replicas (the example)."""
    import autotp
    from examples.train import parse, reference, train

    if DEVICE == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = tiny_llama()
    ids = torch.randint(0, 128, (3, 11), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    sharded = autotp.parallelize(model, (ids,))
    with torch.no_grad():
        out = {"logits": max_diff(sharded(ids).logits, model(ids).logits)}
    sharded(ids).logits.pow(2).mean().backward()
    model(ids).logits.pow(2).mean().backward()
    grads = autotp.full_state_dict(sharded, grads=True)
    out["grads"] = max(max_diff(grads[name], p.grad) for name, p in model.named_parameters() if name in grads)
    prompt = ids[:1, :5]
    mine = autotp.generate(sharded, prompt, max_new_tokens=6, eos_token_id=[])
    theirs = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    out["generate_equal"] = bool(torch.equal(mine, theirs))
    caches = [t for program in sharded.__dict__.get("_autotp_decoders", {}).values() for t in program.buffers()]
    out["devices"] = sorted({str(t.device.type) for t in [*sharded.parameters(), *caches]})
    tiny = [
        "--tp",
        "1",
        "--dp",
        "2",
        "--steps",
        "3",
        "--batch",
        "4",
        "--seq",
        "8",
        "--layers",
        "2",
        "--hidden",
        "32",
        "--vocab",
        "128",
    ]
    trainer, losses = train(parse(tiny), display=False)
    _, expected = reference(parse(tiny))
    out["fsdp_losses"] = max(abs(a - b) for a, b in zip(losses, expected, strict=True))
    out["fsdp_devices"] = sorted({p.device.type for p in trainer.model.parameters()})
    return out


def two_ranks_gloo_cuda() -> dict:
    from autotp.tools.spawn import run_local

    ranks = run_local(2, _on_one_gpu, timeout=240)
    out = {
        "ranks": ranks,
        "exact": all(
            r["logits"] < 1e-4
            and r["grads"] < 1e-4
            and r["fsdp_losses"] < 1e-4
            and r["generate_equal"]
            and r["devices"] == r["fsdp_devices"] == [DEVICE]
            for r in ranks
        ),
    }
    print("  ", out, flush=True)
    return out
