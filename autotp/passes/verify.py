"""``parallelize(..., verify=True)``: run the example inputs through the sharded and the unsharded
model and, if they differ, name the first op whose (reassembled) value diverges."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.fx._pytree import tree_flatten_spec

from autotp.ops.strategies import Strategy
from autotp.ops.table import drops, op
from autotp.placement import Partial, R, Shard, parse
from autotp.runtime.collectives import gather_full


class VerificationError(AssertionError):
    pass


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__(gm)
        self.values: dict = {}

    def run_node(self, node):
        result = super().run_node(node)
        if isinstance(result, torch.Tensor):
            self.values[node.name] = result.detach()
        return result


def _record(gm: torch.fx.GraphModule, args, kwargs) -> dict:
    recorder = _Recorder(gm)
    with torch.no_grad():
        recorder.run(*tree_flatten_spec((tuple(args), dict(kwargs or {})), gm._in_spec))
    return recorder.values


def _full(value: torch.Tensor, placement, shape, group) -> torch.Tensor:
    if isinstance(placement, Shard):
        return gather_full(value, placement, shape[placement.dim], group)
    if isinstance(placement, Partial):
        total = value.clone()
        dist.all_reduce(total, group=group)
        return total
    return value


def _without_dropout(gm: torch.fx.GraphModule) -> None:
    """The capture's ops that draw masks in their one-rank form, switched off (eval mode)."""
    for node in list(gm.graph.nodes):
        if drops(node):
            op(node.target).local(node, Strategy((), R), 0, 1)
    gm.recompile()
    gm.eval()


def verify(
    sharded: torch.fx.GraphModule,
    reference: torch.fx.GraphModule,
    args,
    kwargs=None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> None:
    """A collective.  ``reference``: the unsharded capture of the same model (same node names).  Masks are
    random: a program that drops is compared with its dropouts off."""
    plan, group = sharded.autotp_plan, sharded.autotp_group
    _without_dropout(reference)
    training = sharded.training
    sharded.eval()
    try:
        want = _record(reference, args, kwargs)
        have = _record(sharded, args, kwargs)
    finally:
        sharded.train(training)
    for node in sharded.graph.nodes:  # graph order: the first divergence is the cause
        entry = plan.nodes.get(node.name)
        if entry is None or node.name not in want or node.name not in have or isinstance(entry["out"], list):
            continue
        expected = want[node.name]
        full = _full(have[node.name], parse(entry["out"]), expected.shape, group)
        if full.shape != expected.shape or not torch.allclose(full.float(), expected.float(), rtol=rtol, atol=atol):
            diff = (full.float() - expected.float()).abs().max().item() if full.shape == expected.shape else None
            detail = (
                f"max abs diff {diff:.3g}"
                if diff is not None
                else f"shape {tuple(full.shape)} vs {tuple(expected.shape)}"
            )
            raise VerificationError(
                f"sharded model diverges from the unsharded one first at {node.name} ({entry.get('op')}) in "
                f"{entry.get('module') or 'the top level'}: {detail}, output placement {entry['out']}, "
                f"inputs {entry['in']}; please report it with this plan"
            )
