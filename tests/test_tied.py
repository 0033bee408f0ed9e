"""Tied input/output embeddings across pipeline stages (Megatron's embedding group): GPT-2 trains like one process
on PP 2 and TP 2 x PP 2, and is saved with the tied weight once."""
from __future__ import annotations

import torch
import torch.distributed as dist
from safetensors.torch import load_file

import autotp
from autotp.tools.spawn import run_local

VOCAB, BATCH, SEQ, STEPS = 64, 8, 8, 3


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=4, n_head=4, use_cache=False,
                        tie_word_embeddings=True, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0,
                        eos_token_id=0)
    return GPT2LMHeadModel(config)


def _batch():
    generator = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator))


def _loss(output, target):
    return torch.nn.functional.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def _single_process() -> tuple:
    model, (x, y) = _gpt2(), _batch()
    optimizer, losses = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3), []
    for _ in range(STEPS):
        loss = _loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().numpy() for n, p in model.named_parameters()}


def _train(rank: int, world: int, sizes: tuple, names: tuple, directory: str, want: tuple) -> list:
    from torch.distributed.device_mesh import init_device_mesh
    model, (x, y) = _gpt2(), _batch()
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
    pipe = autotp.parallelize(model, (x,), mesh=mesh, loss_fn=_loss, microbatches=4)
    held = {n for module in pipe.modules.values() for n, _ in module.named_parameters(remove_duplicate=False)}
    assert "lm_head.weight" in held and "transformer.wte.weight" in held  # both stages hold the tied weight
    optimizer, losses = torch.optim.AdamW(pipe.parameters(), lr=1e-2, eps=1e-3), []
    for _ in range(STEPS):
        per_microbatch = []
        pipe.step(x, target=y, losses=per_microbatch)
        optimizer.step()
        optimizer.zero_grad()
        if per_microbatch:
            losses.append(torch.stack(per_microbatch).mean().item())
    if losses:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want[0]), rtol=1e-4, atol=1e-5)
    full = pipe.full_state_dict()
    assert full.keys() == want[1].keys()
    for name, value in want[1].items():
        torch.testing.assert_close(full[name], torch.from_numpy(value), rtol=1e-4, atol=1e-5, msg=name)
    autotp.save_pretrained(pipe, directory)
    return losses if dist.get_rank() == world - 1 else None


def _check(tmp_path, world: int, sizes: tuple, names: tuple) -> None:
    want = _single_process()
    run_local(world, _train, sizes, names, str(tmp_path), want)
    saved = load_file(tmp_path / "model.safetensors")
    assert "transformer.wte.weight" in saved and "lm_head.weight" not in saved  # one tensor, as transformers saves
    torch.testing.assert_close(saved["transformer.wte.weight"], torch.from_numpy(want[1]["transformer.wte.weight"]),
                               rtol=1e-4, atol=1e-5)


def test_tied_embeddings_on_two_stages_train_like_one_process(tmp_path):
    _check(tmp_path, 2, (2,), ("pp",))


def test_tied_embeddings_on_tp2_x_pp2_train_like_one_process(tmp_path):
    _check(tmp_path, 4, (2, 2), ("pp", "tp"))
