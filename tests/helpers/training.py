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


def tp_dp_matches(rank: int, world: int, reference: tuple, sequence_parallel: bool, compiled: bool) -> None:
    """TP 2 x DP 2 of a 2-block LLaMA: FSDP2 units per block (``compiled``: each compiled on its own, as torchtitan
    compiles its blocks); every AdamW step's loss (averaged over the replicas) and the trained parameters equal
    one process's (``reference``: trained_in_one_process of the same model)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import autotp
    from tests.helpers.exact import TOL

    losses, params = reference
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x, y = (t.chunk(2)[mesh["dp"].get_local_rank()] for t in batch())
    sharded = autotp.parallelize(llama(layers=2), (x,), mesh=mesh, sequence_parallel=sequence_parallel)
    assert sharded.autotp_units == ["model.layers.0", "model.layers.1"]
    for path in sharded.autotp_units if compiled else ():
        sharded.get_submodule(path).compile(fullgraph=True)
    optimizer = adamw(sharded.parameters())
    for want in losses:
        loss = token_loss(sharded(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh["dp"].get_group())
        torch.testing.assert_close(mean.item() / 2, want, **TOL)
    trained = autotp.full_state_dict(sharded)
    for name, value in params.items():
        torch.testing.assert_close(trained[name], torch.from_numpy(value), **TOL, msg=name)
