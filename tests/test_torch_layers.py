"""PyTorch's own transformer modules (nn.TransformerEncoderLayer / nn.TransformerDecoderLayer, hence
nn.MultiheadAttention and F.multi_head_attention_forward): the packed in_proj_weight split by heads block by block
(q|k|v; cross-attention's q and k|v pieces), heads merged with the batch unmerged, Megatron's count, exact in
training at 2, 3 and 4 ranks with the original parameter names."""

from __future__ import annotations

import functools

import pytest
import torch

import autotp
from autotp.passes.prepared_graph import prepared_graph
from tests.helpers.distributed import AT_THREE_RANKS, run_ranks
from tests.helpers.exact import same_as_model, sums_per_block
from tests.helpers.native_models import VOCAB, torch_layers_lm

# world -> (kind, heads, batch first, key padding mask)
CASES = {2: ("encoder", 4, True, True), 3: ("decoder", 6, False, False), 4: ("encoder", 4, False, True)}


def _inputs(batch: int, seq: int, padding: bool) -> tuple:
    ids = torch.randint(0, VOCAB, (batch, seq))
    if not padding:
        return (ids,)
    pad = torch.zeros(batch, seq, dtype=torch.bool)
    pad[-1, seq // 2 + 1 :] = True  # the last sequence is shorter
    return ids, pad


def _model(case: tuple) -> torch.nn.Module:
    kind, heads, batch_first, _ = case
    return torch_layers_lm(kind, dim=8 * heads, heads=heads, batch_first=batch_first).train()


def _models(case: tuple) -> list:
    return [(_model(case), _inputs(2, 8, case[3]))]


def _torch_layers(rank: int, world: int, case: tuple) -> None:
    kind, heads, _, padding = case
    model = _model(case)
    sharded = autotp.parallelize(model, _inputs(2, 8, padding))
    plan = sharded.autotp_plan
    assert plan.replicated_ops == [], plan.replicated_ops
    assert dict(sharded.named_parameters()).keys() == dict(model.named_parameters()).keys()  # names kept
    dim = 8 * heads
    attention = [n for n in plan.params if n.endswith("in_proj_weight")]
    assert attention and all(plan.params[n] == f"S(0|{dim},{dim},{dim})" for n in attention), plan.params
    assert all(plan.params[n.replace("in_proj_weight", "out_proj.weight")] == "S(1)" for n in attention)
    per_block = 3 if kind == "decoder" else 2  # Megatron: one all-reduce a sublayer (cross-attention too)
    assert set(sums_per_block(plan).values()) == {per_block}, plan.collectives
    same_as_model(model, sharded, lambda batch, seq: _inputs(batch, seq, padding))


@pytest.mark.parametrize("world", AT_THREE_RANKS)
def test_torch_transformer_layers_split_by_heads(world):
    run_ranks(world, _torch_layers, CASES[world], captures=functools.partial(_models, CASES[world]))


@pytest.mark.parametrize("batch_first", [True, False])
def test_packed_picks_and_merged_heads_are_unmerged(batch_first):
    """The graph the rules see: q|k|v cut by one split of the packed projection, no [B*H, ...] view left."""
    model = torch_layers_lm("decoder", batch_first=batch_first)
    gm = prepared_graph(model, (torch.randint(0, VOCAB, (2, 8)),))
    targets = [n.target for n in gm.graph.nodes]
    assert torch.ops.aten.unflatten.int not in targets and torch.ops.aten.select.int not in targets
    heads = [n for n in gm.graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default]
    assert len(heads) == 5 and all(a.meta["val"].shape[1] == 4 for n in heads for a in n.args[:3])
    assert all(n.args[0].target == torch.ops.aten.permute.default for n in heads)


def _weights_path(rank: int, world: int) -> None:
    model = torch_layers_lm("weights").train()
    sharded = autotp.parallelize(model, (torch.randint(0, VOCAB, (2, 8)),))
    plan = sharded.autotp_plan
    assert plan.replicated_ops == [], plan.replicated_ops
    assert {n: p for n, p in plan.params.items() if n.startswith("attention.")} == {
        **{f"attention.{i}.{w}": "S(0|32,32,32)" for i in (0, 1) for w in ("in_proj_weight", "in_proj_bias")},
        **{f"attention.{i}.out_proj.weight": "S(1)" for i in (0, 1)},
        **{f"attention.{i}.out_proj.bias": "R" for i in (0, 1)},
    }, plan.params
    # the first block's weights are read by nothing: its attention moves no values, its sum is the residual add's
    assert [c for c in plan.collectives if c["module"].startswith("attention.0")] == [], plan.collectives
    same_as_model(model, sharded, lambda batch, seq: (torch.randint(0, VOCAB, (batch, seq)),))


def test_need_weights_path_split_by_heads():
    """F.multi_head_attention_forward with ``need_weights`` (nn.MultiheadAttention's default): q, k and v viewed as
    [S, B*H, hd] and moved to [B*H, S, hd] by a transpose, no view back; ``baddbmm`` with a [1, S, S] mask, ``bmm``,
    the output moved back and viewed as [S*B, E]; the returned weights are averaged over the split heads."""
    run_ranks(2, _weights_path)
