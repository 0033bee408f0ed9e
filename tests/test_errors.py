"""Bad inputs get errors that name the problem and the fix; fallbacks warn; models stay untouched.

(More error cases live beside their features: test_plan.py (world size, plan files, no process
group, missing inputs), test_cost_models.py (topology files, memory limit), test_checkpoint.py
(checkpoint tensors), test_agreement.py (ranks that disagree or die).)"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import autotp
from autotp.passes.capture import CaptureError
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL
from tests.helpers.models import Unruly, build, example_input


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: not capturable
            return self.proj(x)
        return -x


def test_uncapturable_model_shows_the_line_and_the_fix():
    with pytest.raises(CaptureError) as info:
        autotp.plan(Branchy(), (torch.randn(2, 8),), world_size=2)
    message = str(info.value)
    assert "could not capture Branchy" in message
    assert "test_errors.py" in message and "if x.sum() > 0" in message
    assert "data-dependent Python control flow" in message


def test_a_capture_error_shows_the_users_line_from_a_folder_named_autotp(tmp_path):
    """The user's frame is found by where torch and autotp are installed, not by a folder's name: a project (or a
    clone of this repository) in a folder named autotp still sees its own line."""
    import importlib.util
    import inspect

    folder = tmp_path / "autotp"
    folder.mkdir()
    (folder / "user_model.py").write_text(f"import torch\n\n\n{inspect.getsource(Branchy)}")
    spec = importlib.util.spec_from_file_location("user_model", folder / "user_model.py")
    user_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user_model)
    with pytest.raises(CaptureError) as info:
        autotp.plan(user_model.Branchy(), (torch.randn(2, 8),), world_size=2)
    assert f"at {folder / 'user_model.py'}:" in str(info.value) and "if x.sum() > 0" in str(info.value)


def test_example_inputs_of_the_wrong_type():
    model, args, _ = build("mlp")
    with pytest.raises(TypeError, match=r"write \(x,\)"):
        autotp.plan(model, args[0], world_size=2)
    with pytest.raises(TypeError, match="kwargs must be a dict"):
        autotp.plan(model, args, ["not", "a", "dict"], world_size=2)
    with pytest.raises(TypeError, match=r"needs a torch\.nn\.Module"):
        autotp.plan(lambda x: x, args, world_size=2)


def test_unsupported_dtype_is_named():
    model, args, _ = build("mlp")
    model.up.weight = torch.nn.Parameter(model.up.weight.to(torch.complex64))
    with pytest.raises(TypeError, match=r"up\.weight has dtype torch\.complex64"):
        autotp.plan(model, args, world_size=2)


def test_world_size_larger_than_the_topology():
    model, args, _ = build("mlp")
    with pytest.raises(ValueError, match=r"world size 16 is larger than topology dgx-h100 \(8 devices\)"):
        autotp.plan(model, args, world_size=16, topology="dgx-h100")
    assert autotp.plan(model, args, world_size=16, topology="2x-dgx-h100").world_size == 16


def test_ops_without_rules_warn_once_listing_them():
    with pytest.warns(
        UserWarning,
        match=r"2 op\(s\) .* replicated .*aten\.cumprod\.default: no sharding rule.*; "
        r"aten\.sort\.default: no sharding rule",
    ):
        plan = autotp.plan(Unruly(), (torch.randn(2, 8, 32),), world_size=2)
    assert plan.replicated_ops == ["aten.cumprod.default", "aten.sort.default"]
    assert plan.cost["replicated"]["aten.sort.default"].startswith("no sharding rule")
    model, args, _ = build("mlp")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autotp.plan(model, args, world_size=2)


def _twice(rank: int, world: int) -> None:
    model, args, _ = build("llama")
    model.train()  # the training flag and the config's use_cache are restored after capture
    model.config.use_cache = True
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first = autotp.parallelize(model, args)
    second = autotp.parallelize(model, args)
    assert model.training and model.config.use_cache is True
    model.eval()
    torch.manual_seed(3)
    x = example_input("llama", 2, 5)
    want = model(x).logits
    torch.testing.assert_close(first(x).logits, want, **TOL)
    torch.testing.assert_close(second(x).logits, want, **TOL)
    first(x).logits.sum().backward()  # training one copy touches neither the other nor the model
    assert all(p.grad is None for p in second.parameters()) and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_parallelize_twice_on_the_same_model():
    run_ranks(2, _twice)


def _verify_passes(rank: int, world: int) -> None:
    model, args, _ = build("gpt2")
    autotp.parallelize(model, args, verify=True)


def _verify_names_the_first_divergence(rank: int, world: int) -> None:
    from autotp.passes.verify import VerificationError
    from autotp.runtime import collectives

    collectives.all_reduce = lambda x, group, where: x  # a broken collective: partial sums are never summed
    model, args, _ = build("llama")
    # the residual add stays a partial sum (rank 0 adds the stream): the first op to read a broken sum is the norm's
    with pytest.raises(
        VerificationError,
        match=r"first at pow\w* \(aten\.pow\.Tensor_Scalar\) in "
        r"model\.layers\.0\.post_attention_layernorm:",
    ):
        autotp.parallelize(model, args, verify=True)


def _built(kind: str) -> list:
    model, args, _ = build(kind)
    return [(model, args)]


def test_verify():
    run_ranks(2, _verify_passes, captures=functools.partial(_built, "gpt2"))
    run_ranks(2, _verify_names_the_first_divergence, captures=functools.partial(_built, "llama"))
