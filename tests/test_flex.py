"""FlexAttention split by query heads: a BlockMask built in forward or given as an input, score functions that read
the head index (ALiBi slopes from ``h``, or a per-head buffer indexed by it), grouped KV heads.  The captured op runs
forward and backward on the CPU (its dense math), so outputs and gradients are both checked here, at 2, 3 and 4
ranks, against the model itself (run with flex's CPU check lifted, as capture does: the same op)."""

from __future__ import annotations

import dataclasses
import functools
import io
from typing import NamedTuple

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

import autotp
from autotp.ops.flex import exportable_on_cpu
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL, forward_matches, sums_per_block, training_matches
from tests.helpers.native_models import VOCAB, causal, flex_lm

# (mode, query heads, KV heads, world): the head index offset by the rank's first head where h is read
CASES = [
    pytest.param("alibi_h", 4, 2, 2, marks=pytest.mark.slow),
    ("forward_mask", 4, 2, 2),
    ("alibi_buffer", 6, 3, 3),
    ("softcap", 6, 2, 3),
    ("alibi_h", 8, 2, 4),
    ("input_mask", 4, 4, 4),
    ("head_mask", 4, 2, 2),
]


def _by_head(b, h, q, kv):
    """Causal for heads 0 and 1, a window of 3 for the others: a mask with a head dim, read by the head index."""
    return (q >= kv) & ((h < 2) | (q - kv < 3))


def _inputs(mode: str, batch: int, seq: int, heads: int = 4) -> tuple:
    ids = torch.randint(0, VOCAB, (batch, seq))
    if mode == "input_mask":
        return ids, create_block_mask(causal, None, None, seq, seq, device="cpu")
    if mode == "head_mask":  # the block tables have one row per head: split with the heads
        return ids, create_block_mask(_by_head, None, heads, seq, seq, device="cpu")
    return (ids,)


def _flex_model(mode: str, heads: int, kv: int):
    return flex_lm("input_mask" if mode == "head_mask" else mode, dim=8 * heads, heads=heads, kv_heads=kv)


def _masked(mode: str) -> bool:
    return mode in ("input_mask", "head_mask")


def _seq(mode: str) -> int:
    return 16 if _masked(mode) else 8  # a BlockMask input fixes the sequence length


def _flex(rank: int, world: int, mode: str, heads: int, kv: int) -> None:
    model = _flex_model(mode, heads, kv)
    masked = _masked(mode)
    seq = _seq(mode)

    def inputs(batch, length):
        return _inputs(mode, batch, length, heads)

    sharded = autotp.parallelize(model, inputs(2, seq))
    plan = sharded.autotp_plan
    assert plan.replicated_ops == [], plan.replicated_ops
    flex = [entry for entry in plan.nodes.values() if entry["op"] == "flex_attention"]
    assert len(flex) == 2 and all(entry["out"][0].startswith("S(1") for entry in flex), flex
    assert set(sums_per_block(plan).values()) == {2}, plan.collectives
    if mode == "head_mask":
        tables = [entry["in"] for entry in plan.nodes.values() if entry["op"] == "flex_attention"]
        assert all(p == "S(1)" for entry in tables for p in entry[3:] if p is not None), tables  # not gathered
    torch.manual_seed(1)
    other = (16, 16) if masked else (5, 1)
    with exportable_on_cpu():  # the model itself, with flex_attention's CPU check lifted, is the reference
        forward_matches(model, sharded, [inputs(3, seq), inputs(1, other[0]), inputs(2, other[1])])
        training_matches(model, sharded, [inputs(2, seq) for _ in range(2)])


@pytest.mark.parametrize(("mode", "heads", "kv", "world"), CASES)
def test_flex_attention_is_split_by_query_heads(mode, heads, kv, world):
    run_ranks(world, _flex, mode, heads, kv, captures=functools.partial(_flex_models, mode, heads, kv))


def _flex_models(mode: str, heads: int, kv: int) -> list:
    return [(_flex_model(mode, heads, kv), _inputs(mode, 2, _seq(mode), heads))]


def test_the_cpu_check_that_capture_lifts_is_where_it_was():
    """capture relies on a private function of torch's flex_attention module: fail loudly if it moves."""
    import torch.nn.attention.flex_attention as flex_api

    q = torch.zeros(1, 1, 16, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        flex_api._validate_device(q, q, q)
    with exportable_on_cpu():
        flex_api._validate_device(q, q, q)


class Batch(NamedTuple):
    ids: torch.Tensor
    mask: BlockMask


@dataclasses.dataclass
class Scaled:
    ids: torch.Tensor
    scale: torch.Tensor


class _Structured(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = flex_lm("input_mask")

    def forward(self, batch: Batch, scaled: Scaled):
        return self.model(batch.ids, batch.mask) * scaled.scale + self.model.emb(scaled.ids).sum(-1, keepdim=True)


def test_structured_inputs_keep_the_signature():
    """A NamedTuple holding a BlockMask and a dataclass (registered as pytrees at capture) are planned; the plan
    splits attention by heads."""
    ids = torch.randint(0, VOCAB, (2, 16))
    batch = Batch(ids, create_block_mask(causal, None, None, 16, 16, device="cpu"))
    plan = autotp.plan(_Structured(), (batch, Scaled(ids, torch.ones(1))), world_size=2)
    assert plan.replicated_ops == []
    assert [entry["out"][0] for entry in plan.nodes.values() if entry["op"] == "flex_attention"] == ["S(1)"] * 2


def _structured_example() -> tuple:
    model = _Structured()
    ids = torch.randint(0, VOCAB, (2, 16))
    batch = Batch(ids, create_block_mask(causal, None, None, 16, 16, device="cpu"))
    return model, (batch, Scaled(ids, torch.ones(1)))


def _structured(rank: int, world: int) -> None:
    model, example = _structured_example()
    sharded = autotp.parallelize(model, example)
    other = torch.randint(0, VOCAB, (3, 16))
    args = (Batch(other, create_block_mask(causal, None, None, 16, 16, device="cpu")), Scaled(other, torch.ones(1) * 2))
    with exportable_on_cpu():
        torch.testing.assert_close(sharded(*args), model(*args), **TOL)


def test_structured_inputs_run_sharded():
    run_ranks(2, _structured, captures=_structured_examples)


def _structured_examples() -> list:
    return [_structured_example()]


def test_heads_that_cannot_meet_their_kv_heads_are_said_in_the_plan():
    """8 query heads and 2 KV heads on 3 ranks: rank 1 computes query heads 3-5 (of KV heads 0, 0, 1), which no
    grouping of its local heads gives, so the op runs replicated and `autotp plan` says why."""
    from rich.console import Console

    from autotp.tools.report import print_plan

    plan = autotp.plan(flex_lm("alibi_h", dim=64, heads=8, kv_heads=2), _inputs("alibi_h", 2, 8), world_size=3)
    assert plan.replicated_ops == ["flex_attention"]
    console = Console(file=io.StringIO(), width=200)
    print_plan(plan, console=console)
    assert (
        "runs replicated: flex_attention: no split of its 8 query heads on 3 ranks meets its 2 KV heads"
        in console.file.getvalue()
    )


def _unsplit_example() -> tuple:
    return flex_lm("alibi_h", dim=64, heads=8, kv_heads=2), _inputs("alibi_h", 2, 8)


def _unsplit(rank: int, world: int) -> None:
    model, example = _unsplit_example()
    sharded = autotp.parallelize(model, example)
    assert sharded.autotp_plan.replicated_ops == ["flex_attention"]
    torch.manual_seed(1)
    with exportable_on_cpu():
        forward_matches(model, sharded, [_inputs("alibi_h", 3, 5)])
        training_matches(model, sharded, [_inputs("alibi_h", 2, 6)])


def test_heads_that_cannot_meet_their_kv_heads_run_replicated_and_exact():
    run_ranks(3, _unsplit, captures=_unsplit_examples)


def _unsplit_examples() -> list:
    return [_unsplit_example()]
