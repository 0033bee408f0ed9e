"""The Hugging Face architectures of tests/test_architectures.py (configs.ARCHITECTURES) and the check that a
sharded one computes what the model computes, gradients included."""

from __future__ import annotations

import torch

import autotp
from tests.helpers import configs
from tests.helpers.distributed import weight_collectives
from tests.helpers.exact import TOL

NAMES = list(configs.ARCHITECTURES)


def hf_model(name: str, **overrides):
    """``configs.ARCHITECTURES[name]``'s model (with ``overrides`` to its config), fixed seed, eval mode."""
    import transformers

    _, model_cls, _ = configs.ARCHITECTURES[name]
    config = configs.architecture(name, **overrides)
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).eval()


def out(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    return output.logits if hasattr(output, "logits") else output.last_hidden_state


def ids(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, 90, (batch, seq))


def same_as_unsharded(model, sharded, tol=TOL, inputs=ids) -> None:
    """Outputs at other shapes (1 x 1 included) and gradients; ``inputs(batch, seq)`` makes the input."""
    assert not weight_collectives(sharded), weight_collectives(sharded)  # weights are used where stored
    torch.manual_seed(1)
    for batch, seq in [(3, 7), (1, 1)]:
        x = inputs(batch, seq)
        torch.testing.assert_close(out(sharded(x)), out(model(x)), **tol)
    x = inputs(2, 6)
    out(sharded(x)).float().square().mean().backward()
    out(model(x)).float().square().mean().backward()
    grads = autotp.full_state_dict(sharded, grads=True)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, **tol, msg=lambda m, n=name: f"{n}: {m}")
