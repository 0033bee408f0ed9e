"""What users change after the capture (issue 33): a model sharded with ``autotp.parallelize(model, example)`` at 2
gloo ranks stays equal to the single-process model (fp32: TOL) when it is switched between eval and train, called
with padded batches (an attention mask) and packed sequences (position ids that restart), at batch 1 and sequence
1 after a capture at batch 2, under a bfloat16 autocast, and trained with gradients accumulated over micro-batches.

One launch of 2 ranks runs every check (each rank captures on its own, as users' do: no shared captures) and
reports each one's error or None: a failure names its check and what differed, and the other checks still run."""

from __future__ import annotations

import traceback
import warnings

import pytest
import torch

import autotp
from tests.helpers import configs
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL, forward_matches, logits

VOCAB = 96
P = 0.1  # the GPT-2 of the mode checks drops everywhere
# bfloat16 keeps 8 bits of mantissa (2^-8 ~ 4e-3 relative rounding).  Under autocast every matmul rounds its output
# to bf16, and a sharded matmul rounds each rank's partial product before the all-reduce sums them where one process
# rounds the whole sum once, so the two differ by a few bf16 roundings, not by fp32 noise.  Logits here are ~0.5:
# measured 2.2e-3 apart (2026-12-02), while autocast itself moves them 3e-3 from fp32; hence the dtype checks below.
BF16_TOL = {"rtol": 1e-2, "atol": 1e-2}
# gradients under autocast, per parameter, relative to its largest element (gradients span 3e-4 .. 1e-1 here, so one
# atol cannot fit them all): measured at most 0.8% apart, the bf16 roundings of a backward through 2 blocks
BF16_GRAD = 3e-2


def _llama():
    """The tiny LLaMA of tests/helpers/configs.py (2 blocks of 64, 4 heads sharing 2 KV heads, SDPA) in eval mode,
    with attention dropout (SDPA's dropout_p, passed only in training mode)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(configs.llama(attention_dropout=P)).eval()


def _gpt2():
    """GPT-2 dropping on embeddings, attention (SDPA's dropout_p) and both residual branches, in training mode."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    config = configs.gpt2(bos_token_id=0, eos_token_id=0, attn_pdrop=P, resid_pdrop=P, embd_pdrop=P)
    return GPT2LMHeadModel(config).train()


def _ids(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq))


def _loss(out) -> torch.Tensor:
    return logits(out).float().logsumexp(-1).mean()


def _same_grads(model, sharded, what: str) -> None:
    grads = autotp.full_state_dict(sharded, grads=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{what}, grad {n}: {m}")


def _same_weights(model, sharded, what: str) -> None:
    weights = autotp.full_state_dict(sharded)
    for name, p in model.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), **TOL, msg=lambda m, n=name: f"{what}, {n}: {m}")


def _zero_grads(*models) -> None:
    for m in models:
        m.zero_grad(set_to_none=True)


# ---- the checks, each run on every rank --------------------------------------------------------------------------


def _train_eval_train() -> None:
    """Captured in training mode (reference dropout: one process's masks), a step, then eval, then train and a step."""
    model = _gpt2()
    sharded = autotp.parallelize(model, (_ids(2, 8),), dropout="reference")
    assert sharded.training
    ours, theirs = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (sharded, model))

    def step(what: str) -> None:  # seeded alike: the same masks in both
        x = _ids(3, 7)
        torch.manual_seed(100)
        loss = _loss(sharded(x))
        loss.backward()
        torch.manual_seed(100)
        want = _loss(model(x))
        want.backward()
        torch.testing.assert_close(loss, want, **TOL, msg=lambda m: f"{what}, loss: {m}")
        _same_grads(model, sharded, what)
        for o in (ours, theirs):
            o.step()
            o.zero_grad()

    step("training step before eval()")
    sharded.eval(), model.eval()
    assert not sharded.training and not any(m.training for m in sharded.modules())
    with torch.no_grad():
        for shape in ((3, 7), (1, 1)):
            x = _ids(*shape)
            want = logits(model(x))
            for _ in range(2):  # eval draws nothing: the same outputs every call
                torch.testing.assert_close(logits(sharded(x)), want, **TOL, msg=lambda m, s=shape: f"eval {s}: {m}")
    sharded.train(), model.train()
    assert sharded.training
    x = _ids(3, 7)
    with torch.no_grad():
        dropped = logits(sharded(x))
        assert not torch.allclose(dropped, logits(model.eval()(x)), **TOL), "train() after eval(): nothing drops"
    model.train()
    step("training step after eval() and train()")
    _same_weights(model, sharded, "after train -> eval -> train")


def _padded() -> None:
    """Captured with an all-ones attention mask; called with left and right padding, at batch 3, 1 and 1 x 1."""
    model = _llama()
    ids = _ids(2, 8)
    sharded = autotp.parallelize(model, (ids,), {"attention_mask": torch.ones_like(ids)})
    x = _ids(3, 9)
    mask = torch.ones_like(x)
    mask[0, :3] = 0  # left padding
    mask[1, 6:] = 0  # right padding
    with torch.no_grad():
        assert not torch.allclose(logits(model(x, attention_mask=mask)), logits(model(x))), "the mask changes nothing"
        for ids, m in ((x, mask), (x[:1], mask[:1]), (x[2:, :1], mask[2:, :1])):
            out, want = logits(sharded(ids, attention_mask=m)), logits(model(ids, attention_mask=m))
            torch.testing.assert_close(out, want, **TOL, msg=lambda e, s=tuple(m.shape): f"padded {s}: {e}")
    keep = mask.bool()  # a loss over the real tokens
    logits(sharded(x, attention_mask=mask))[keep].logsumexp(-1).mean().backward()
    logits(model(x, attention_mask=mask))[keep].logsumexp(-1).mean().backward()
    _same_grads(model, sharded, "padded batch")


def _packed() -> None:
    """Captured with position ids 0..n-1 and no mask; called with rows packing several sequences (positions restart,
    and transformers then attends within each sequence only), at batch 2, 1 and sequence 1."""
    model = _llama()
    sharded = autotp.parallelize(model, (_ids(2, 8),), {"position_ids": torch.arange(8).expand(2, 8)})
    x = _ids(2, 10)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4, 5, 6, 7]])
    with torch.no_grad():
        plain = logits(model(x, position_ids=torch.arange(10).expand(2, 10)))
        assert not torch.allclose(logits(model(x, position_ids=positions)), plain), "packing changes nothing"
        for ids, pos in ((x, positions), (x[1:], positions[1:]), (x[:, 4:5], positions[:, 4:5])):
            out, want = logits(sharded(ids, position_ids=pos)), logits(model(ids, position_ids=pos))
            torch.testing.assert_close(out, want, **TOL, msg=lambda e, s=tuple(ids.shape): f"packed {s}: {e}")
    _loss(sharded(x, position_ids=positions)).backward()
    _loss(model(x, position_ids=positions)).backward()
    _same_grads(model, sharded, "packed rows")


def _small_shapes(model, sharded) -> None:
    """Captured at batch 2 x 8: batch 1, sequence 1 and 1 x 1 equal one process, running the plan's collectives;
    the gradients at 1 x 1 too."""
    forward_matches(model, sharded, [(_ids(1, 8),), (_ids(2, 1),), (_ids(1, 1),)])
    x = _ids(1, 1)
    for m in (sharded, model):
        _loss(m(x)).backward()
    _same_grads(model, sharded, "batch 1 x sequence 1")
    _zero_grads(sharded, model)


def _autocast(model, sharded) -> None:
    """Under torch.autocast("cpu", bfloat16) in both: bf16 logits within BF16_TOL, gradients within BF16_GRAD."""
    x = _ids(2, 8)
    with torch.no_grad():
        fp32 = logits(sharded(x))
    outs = []
    for m in (sharded, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = logits(m(x))
        outs.append(out)
        _loss(out).backward()
    out, want = outs
    assert out.dtype == want.dtype == torch.bfloat16, (out.dtype, want.dtype)
    assert not torch.allclose(out.float(), fp32, **TOL), "the sharded program ignores the autocast"
    torch.testing.assert_close(out.float(), want.float(), **BF16_TOL, msg=lambda e: f"bf16 logits: {e}")
    grads = autotp.full_state_dict(sharded, grads=True)
    for name, p in model.named_parameters():
        assert grads[name].dtype == torch.float32, (name, grads[name].dtype)
        scale = float(p.grad.abs().max())
        torch.testing.assert_close(
            grads[name], p.grad, rtol=BF16_GRAD, atol=BF16_GRAD * scale, msg=lambda e, n=name: f"bf16 grad {n}: {e}"
        )
    _zero_grads(sharded, model)
    with torch.no_grad():  # and the autocast leaves nothing behind: fp32 again after it
        torch.testing.assert_close(logits(sharded(x)), fp32, rtol=0, atol=0, msg=lambda e: f"fp32 after bf16: {e}")


def _accumulated(model, sharded) -> None:
    """Two optimizer steps, each of gradients accumulated over 2 micro-batches (of different shapes)."""
    ours, theirs = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (sharded, model))
    for step in range(2):
        micro = [_ids(2, 6), _ids(1, 4)]
        for m in (sharded, model):
            for x in micro:
                (_loss(m(x)) / len(micro)).backward()
        _same_grads(model, sharded, f"step {step}, accumulated over {len(micro)} micro-batches")
        for o in (ours, theirs):
            o.step()
            o.zero_grad()
    _same_weights(model, sharded, "after 2 steps of 2 accumulated micro-batches")


def _eval_then_train(model, sharded) -> None:
    """Captured in eval mode, then switched to train: the call gets a program captured in training mode (one
    captured in eval mode has no op that drops), so it drops as the model in one process does; back in eval
    mode the first program serves, exact again."""
    x = _ids(3, 7)
    sharded.train()
    with pytest.warns(UserWarning, match="captured in eval mode and now runs in training mode"):
        dropped = logits(sharded(x))
    again = logits(sharded(x))
    assert [p.autotp_captured_training for p in sharded.autotp_programs.others.values()] == [True]
    sharded.eval()
    whole = logits(sharded(x))
    torch.testing.assert_close(whole, logits(model(x)), **TOL)
    assert not torch.allclose(dropped, whole, **TOL) and not torch.allclose(dropped, again, **TOL), "it drops"


def _all(rank: int, world: int) -> dict:
    """Each check's error (the traceback's last frames) or None; every rank runs the same checks and so fails alike."""
    warnings.simplefilter("ignore")
    found = {}

    def check(name, fn, *args):
        torch.manual_seed(1)
        try:
            fn(*args)
            found[name] = None
        except Exception:  # reported by the check's own test below
            found[name] = traceback.format_exc(limit=-3)

    check("train_eval_train", _train_eval_train)
    check("padded", _padded)
    check("packed", _packed)
    model = _llama()  # one plain capture in eval mode for the last four (those that train after those that do not)
    sharded = autotp.parallelize(model, (_ids(2, 8),))
    check("small_shapes", _small_shapes, model, sharded)
    check("autocast", _autocast, model, sharded)
    check("accumulated", _accumulated, model, sharded)
    check("eval_then_train", _eval_then_train, model, sharded)
    return found


def test_the_sharded_model_stays_exact_after_what_users_change():
    """One test for the one launch (pytest-xdist's worksteal could split several tests of a module-scoped launch
    across workers, launching it twice); the message names each check that failed, with its error."""
    first, second = run_ranks(2, _all)
    failed = {name: first[name] or second[name] for name in first if first[name] or second[name]}
    assert not failed, "\n".join(f"check {name!r} failed:\n{error}" for name, error in failed.items())
