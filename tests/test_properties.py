"""Property-based: random MLP and transformer shapes at world sizes 1-4 (divisible or not) give the
unsharded model's outputs and gradients.  Few examples each: every one spawns real gloo ranks."""

from __future__ import annotations

import functools

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autotp
from tests.helpers import configs
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL

SETTINGS = settings(
    max_examples=5,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _model(build) -> torch.nn.Module:
    torch.manual_seed(0)
    return build().eval()


def _models(build, x) -> list:
    return [(_model(build), (x,))]


def _compare(rank: int, world: int, build, x) -> None:
    model = _model(build)
    sharded = autotp.parallelize(model, (x,))
    out, want = sharded(x), model(x)
    out, want = getattr(out, "logits", out), getattr(want, "logits", want)
    torch.testing.assert_close(out, want, **TOL)
    out.square().mean().backward()
    want.square().mean().backward()
    grads = autotp.full_state_dict(sharded, grads=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


class _MLP:
    def __init__(self, hidden: int, ffn: int, bias: bool):
        self.args = (hidden, ffn, bias)

    def __call__(self):
        hidden, ffn, bias = self.args
        return torch.nn.Sequential(
            torch.nn.Linear(hidden, ffn, bias=bias), torch.nn.GELU(), torch.nn.Linear(ffn, hidden, bias=bias)
        )


@SETTINGS
@given(
    world=st.integers(1, 4),
    hidden=st.sampled_from([4, 6, 8, 12]),
    ffn=st.sampled_from([6, 8, 12, 16]),
    bias=st.booleans(),
    batch=st.integers(1, 3),
    seq=st.integers(1, 4),
)
def test_random_mlps(world, hidden, ffn, bias, batch, seq):
    torch.manual_seed(1)
    build, x = _MLP(hidden, ffn, bias), torch.randn(batch, seq, hidden)
    run_ranks(world, _compare, build, x, captures=functools.partial(_models, build, x))


class _Llama:
    def __init__(self, **config):
        self.config = config

    def __call__(self):
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(configs.llama(**self.config, max_position_embeddings=32))


@SETTINGS
@given(world=st.integers(1, 4), data=st.data())
def test_random_transformers(world, data):
    head_dim = data.draw(st.sampled_from([4, 8]), "head_dim")
    kv = data.draw(st.sampled_from([1, 2, 3, 4]), "kv_heads")
    heads = kv * data.draw(st.integers(1, 3), "group")
    config = {
        "hidden_size": heads * head_dim,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": data.draw(st.sampled_from([8, 12, 24]), "ffn"),
        "vocab_size": data.draw(st.sampled_from([30, 32, 40]), "vocab"),
        "num_hidden_layers": data.draw(st.integers(1, 2), "layers"),
    }
    torch.manual_seed(2)
    x = torch.randint(0, 30, (data.draw(st.integers(1, 2), "batch"), data.draw(st.integers(1, 5), "seq")))
    build = _Llama(**config)
    run_ranks(world, _compare, build, x, captures=functools.partial(_models, build, x))
