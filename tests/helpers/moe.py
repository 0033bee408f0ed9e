"""Mixture-of-experts models and checks shared by tests/test_moe.py, tests/test_moe_dispatch.py and
tests/test_expert_checkpoints.py."""

from __future__ import annotations

import torch
from torch.distributed.tensor.debug import CommDebugMode

import autotp
from autotp.runtime.hf_models import default_inputs
from examples import moe
from tests.helpers import configs
from tests.helpers.distributed import comm_counts, plan_ops, weight_collectives
from tests.helpers.exact import TOL


def mixtral(experts: int = 4, layers: int = 2, implementation: str | None = None):
    from transformers import MixtralForCausalLM

    torch.manual_seed(0)
    config = configs.mixtral(num_hidden_layers=layers, num_local_experts=experts)
    if implementation:
        config._experts_implementation = implementation
    return MixtralForCausalLM(config).eval()


def qwen3_moe(experts: int = 8, layers: int = 2):
    """Experts of 32 rows: a router of 2% of an expert tensor's size would count as large (strategies.py)."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(configs.qwen3_moe(num_hidden_layers=layers, num_experts=experts)).eval()


def expert_params(model) -> list[str]:
    return [name for name, p in model.named_parameters() if p.dim() == 3]


def _logits(out):
    return getattr(out, "logits", out)


def same_as_unsharded(model, sharded, inputs) -> None:
    """Outputs at batch 3 x 11 and 1 x 1, and every gradient."""
    torch.manual_seed(1)
    for batch, seq in [(3, 11), (1, 1)]:
        x = inputs(batch, seq)
        torch.testing.assert_close(_logits(sharded(x)), _logits(model(x)), **TOL)
    x = inputs(2, 5)
    _logits(sharded(x)).square().mean().backward()
    _logits(model(x)).square().mean().backward()
    grads = autotp.full_state_dict(sharded, grads=True)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def runs_the_plan(sharded, plan, x) -> None:
    """No weight travels; CommDebugMode counts what the plan says, forward and backward."""
    assert not weight_collectives(sharded), weight_collectives(sharded)
    transport = autotp.runtime.transport
    one_shot, transport.ONE_SHOT_BYTES = transport.ONE_SHOT_BYTES, 0  # count all-reduces as such
    with CommDebugMode() as forward:
        out = _logits(sharded(x)).square().mean()
    with CommDebugMode() as backward:
        out.backward()
    transport.ONE_SHOT_BYTES = one_shot
    assert plan_ops(comm_counts(forward)) == plan.collective_counts("forward"), comm_counts(forward)
    assert plan_ops(comm_counts(backward)) == plan.collective_counts("backward"), comm_counts(backward)
    sharded.zero_grad(set_to_none=True)


def pretrained(directory: str):
    """The model ``autotp.from_pretrained(directory)`` builds (on the meta device) and captures."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=None)
    model.tie_weights()
    return model.eval()


def with_default_inputs(models: list) -> list:
    """(model, args) pairs for models parallelized without example inputs."""
    return [(model, default_inputs(model)) for model in models]


def six_experts() -> tuple:
    """examples/moe.py with 6 experts, gate and up interleaved, biases on every expert projection; eval mode."""
    torch.manual_seed(0)
    model, args = moe.build(experts=6, interleaved=True, bias=True)
    return model.eval(), args


def six_experts_models() -> list:
    return [six_experts()]
