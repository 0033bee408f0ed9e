"""Training in one process, what the pipeline tests (tests/test_pipeline.py, tests/test_recompute.py) compare
pipelined training with: a 4-block LLaMA, one fixed batch, AdamW, ``STEPS`` steps."""

from __future__ import annotations

import torch

from tests.helpers import configs

VOCAB, BATCH, SEQ, STEPS = 64, 8, 8, 3


def llama(layers: int = 4, vocab: int = VOCAB):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = configs.llama(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, tie_word_embeddings=False
    )
    return LlamaForCausalLM(config)


def batch():
    generator = torch.Generator().manual_seed(1)
    return (
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
    )


def token_loss(output, target):
    return torch.nn.functional.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def adamw(params):
    """AdamW with eps well above fp32 gradient noise: at the default 1e-8 an element whose gradient is ~1e-9
    moves by lr * g / (|g| + eps), so rounding differences of ~1e-8 between two exact summation orders (TP
    sums partial products in another order) change its step by a sizeable part of lr."""
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)


def trained_in_one_process(build=llama) -> tuple:
    """Trained in one process: losses per step and parameters after the last step (numpy, to send to ranks)."""
    model, (x, y) = build(), batch()
    optimizer, losses = adamw(model.parameters()), []
    for _ in range(STEPS):
        loss = token_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().numpy() for n, p in model.named_parameters()}
