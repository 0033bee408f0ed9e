"""Graphs the coverage sweep found planning crashed on (benchmarks/coverage_sweep.py): each plans now, and the
ones that run are exact at 2 ranks against one process."""

from __future__ import annotations

from types import MappingProxyType

import pytest
import torch
from torch import nn

import autotp
from autotp.passes.fold import find_fold
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL


class Selected(nn.Module):
    """Rows picked by a mask of their values (a router's, a detector's): a size only the data knows (u0)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        picked = x[x.sum(-1) > 0]
        return self.down(self.up(picked).relu()).sum(0) + x.sum((0, 1))


class EmptyWindows(nn.Module):
    """Heads viewed out of a run of zero rows (Swin's padding where an image needs none): a size 0 in a view."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        b = x.shape[0]
        h = self.up(x)
        none = h[:, :0].view(b, 0, 4, 16).transpose(1, 2).reshape(b * 4, 0, 16)
        return self.down(h.relu()) + none.sum()


class ViewedAsNumber(nn.Module):
    """A one-element tensor viewed as a number (ViT-MAE's and Pixtral's ``noise.view(())``-like scalars, VITS's):
    a view with no rows."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        scale = self.up.bias[:1].reshape(())
        return self.down(self.up(x).relu()) * scale


class Halves(nn.Module):
    """The sequence split in two by a size computed from it (ProphetNet's main and predicted streams)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        first, second = self.up(x).chunk(2, dim=1)
        return self.down(first.relu()) + self.down(second.relu())


class Tower(nn.Module):
    """A vision tower handed the text's inputs too, which its forward takes through ``**kwargs`` and ignores
    (Idefics3's, SmolVLM's): torch.export (2.13) matches no dynamic shapes to such inputs."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x, **kwargs):
        return self.down(self.up(x).relu())


class RowUpdates(nn.Module):
    """Kimi Linear's intra-chunk solve: rows of a per-head matrix rewritten in place one after another
    (``attn[..., i, :i] = ...``, a ``copy_`` into a view, which has no rule).  Its heads imposed split."""

    H, D = 4, 8
    SPLIT = MappingProxyType({"q.weight": "S(0)", "k.weight": "S(0)", "v.weight": "S(0)", "o.weight": "S(1)"})

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(16, self.H * self.D, bias=False) for _ in range(3))
        self.o = nn.Linear(self.H * self.D, 16, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, self.H, self.D).transpose(1, 2) for f in (self.q, self.k, self.v))
        attn = -(q @ k.transpose(-1, -2))
        for i in range(1, s):
            row = attn[..., i, :i].clone()
            attn[..., i, :i] = row + (row.unsqueeze(-1) * attn[..., :i, :i].clone()).sum(-2)
        return self.o((attn @ v).transpose(1, 2).reshape(b, s, -1))


def _plan(model, x):
    return autotp.plan(model, (), {"x": x}, world_size=2)


def test_a_size_only_the_data_knows_is_priced():
    plan = _plan(Selected(), torch.randn(2, 8, 16))
    assert plan.params["up.weight"] != "R"  # planned, and the MLP still split


def test_a_view_with_a_size_0_plans():
    plan = _plan(EmptyWindows(), torch.randn(2, 8, 16))
    assert plan.params["up.weight"] != "R"


def test_a_view_to_a_number_plans():
    plan = _plan(ViewedAsNumber(), torch.randn(2, 8, 16))
    assert plan.params["up.weight"] != "R"


def test_pieces_of_a_dynamic_size_are_not_sharded_along_it():
    plan = _plan(Halves(), torch.randn(2, 8, 16))
    assert plan.params["up.weight"] != "R"


def test_a_tensor_written_in_place_is_read_as_placed():
    """A copy moved to another placement would miss the writes (the gathered copy gets them, the shard not)."""
    from autotp.placement import parse

    model = RowUpdates()
    plan = autotp.plan(model, (), {"x": torch.randn(2, 4, 16)}, world_size=2, fixed=RowUpdates.SPLIT)
    written = [n for n, v in plan.nodes.items() if v["op"] == "aten.neg.default"]
    readers = [v for v in plan.nodes.values() if written[0] in v["args"]]
    assert readers and all(
        parse(v["in"][v["args"].index(written[0])]) == parse(plan.nodes[written[0]]["out"]) for v in readers
    )


def test_a_module_list_holding_none_is_not_folded():
    blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(6)] + [None])
    assert find_fold(nn.ModuleDict({"blocks": blocks})) is None


def _run(rank: int, world: int) -> None:
    for make in (Selected, EmptyWindows, Halves):
        torch.manual_seed(0)
        model, x = make(), torch.randn(2, 8, 16)
        sharded = autotp.parallelize(model, (), {"x": x})
        for y in (x, torch.randn(3, 6, 16)):
            torch.testing.assert_close(sharded(x=y), model(x=y), **TOL)
        _trains_alike(model, sharded, x)
    torch.manual_seed(0)  # its heads split, as the coverage sweep's price_at made kimi_linear's
    model, x = RowUpdates(), torch.randn(2, 4, 16)
    sharded = autotp.parallelize(model, (), {"x": x}, fixed=RowUpdates.SPLIT)
    for y in (x, torch.randn(1, 6, 16)):
        torch.testing.assert_close(sharded(x=y), model(x=y), **TOL)
    _trains_alike(model, sharded, x)


def _trains_alike(model, sharded, x) -> None:
    sharded(x=x).square().mean().backward()
    model(x=x).square().mean().backward()
    grads = autotp.full_state_dict(sharded, grads=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL)


def _tower(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model, x, ids = Tower(), torch.randn(2, 8, 16), torch.zeros(2, 8, dtype=torch.long)
    with pytest.warns(UserWarning, match=r"input_ids reach Tower.forward through \*\*kwargs"):
        sharded = autotp.parallelize(model, (), {"x": x, "input_ids": ids})
    assert sharded.autotp_plan.params["up.weight"] != "R"
    for y in (x, torch.randn(3, 5, 16)):  # another size: a program of its own
        torch.testing.assert_close(sharded(x=y, input_ids=ids), model(x=y), **TOL)


def test_inputs_through_var_keyword_are_captured_at_their_sizes():
    run_ranks(2, _tower)


def test_they_run_exact_at_two_ranks():
    run_ranks(2, _run)


def test_a_fused_dim_of_empty_blocks_holds_all_of_nothing():
    """HunYuan v4 fuses blocks of size 0: a rank holds all of such a tensor (its share of 0 bytes is 0 bytes)."""
    from autotp.cost_models.pricing import held_fraction
    from autotp.placement import Shard

    assert held_fraction(Shard(0, chunks=(0, 0)), 2) == 1.0


def test_a_size_the_example_fixes_is_said_once_in_autotps_words(caplog):
    """torch.export logs "dimension inputs[...] 0/1 specialized" for a batch of 1 on every capture; autotp holds the
    line back and warns once what it means for the user (issue 34: quiet, in its own words)."""
    import logging
    import warnings

    from autotp.passes.capture import capture

    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        capture(Halves(), (), {"x": torch.randn(1, 8, 16)})
    said = [str(w.message) for w in caught if "autotp: the example inputs fix" in str(w.message)]
    assert len(said) == 1 and "inputs['x'].shape[0] at 1" in said[0], [str(w.message) for w in caught]
    assert not [r for r in caplog.records if "specialized" in r.getMessage()]
