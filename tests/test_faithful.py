"""A captured program that is not the model is refused (passes/faithful.py): a model whose code takes another branch
while torch.export traces it would be sharded exactly and still compute other values than the user's model.
No ranks: ``autotp.plan`` captures as ``parallelize`` does."""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.passes.faithful import UnfaithfulCapture


class TracedOtherwise(torch.nn.Module):
    """Scales by 2 eagerly and by 3 while exported: the shape of transformers' mask code under torch.export."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        scale = 3.0 if torch.compiler.is_exporting() else 2.0
        return self.down(torch.relu(self.up(x))) * scale


class Mlp(torch.nn.Module):
    def __init__(self, p: float = 0.0, norm: bool = False):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
        self.drop = torch.nn.Dropout(p)
        self.norm = torch.nn.BatchNorm1d(16) if norm else torch.nn.Identity()

    def forward(self, x):
        return self.norm(self.down(self.drop(torch.relu(self.up(x)))))


def test_a_program_that_is_not_the_model_is_refused_in_one_line():
    with pytest.raises(UnfaithfulCapture) as caught:
        autotp.plan(TracedOtherwise(), (torch.randn(4, 16),), world_size=2)
    message = str(caught.value)
    assert "\n" not in message and "TracedOtherwise" in message and "differs from the model run eagerly" in message


def test_a_faithful_program_plans():
    plan = autotp.plan(Mlp(), (torch.randn(4, 16),), world_size=2)
    assert plan.params["up.weight"] != "R"  # a plan was made: the check passed and did not change the capture


def test_randomness_and_written_buffers_are_not_compared():
    """Dropout in training mode draws other masks in the two forwards, and BatchNorm in training mode updates its
    running statistics: neither is compared (no false alarm), and the statistics are not moved by the check."""
    torch.manual_seed(0)
    autotp.plan(Mlp(p=0.5).train(), (torch.randn(4, 16),), world_size=2)
    model = Mlp(norm=True).train()
    before = model.norm.running_mean.clone()
    autotp.plan(model, (torch.randn(4, 16),), world_size=2)
    torch.testing.assert_close(model.norm.running_mean, before, rtol=0, atol=0)


def test_transformers_paligemma_without_images_is_refused():
    """PaliGemma's language model attends bidirectionally eagerly (its attention is not causal and no mask is made
    for inputs without padding) but causally under torch.export (the mask is then built): 0.7 apart."""
    from transformers import PaliGemmaModel

    from tests.helpers import configs

    torch.manual_seed(0)
    model = PaliGemmaModel(configs.paligemma()).eval()
    with pytest.raises(UnfaithfulCapture, match="PaliGemmaModel"):
        autotp.plan(model, (), {"input_ids": torch.randint(0, 100, (2, 8))}, world_size=2)
