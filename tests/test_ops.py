"""Every row of the op table (autotp/ops/table.py), checked rank by rank in one process.

Small programs that use each op are captured as autotp captures models; for every node, every strategy its
row's rule proposes (at 2, 3 and 4 ranks, sequence parallelism offered) is run on each simulated rank: inputs
laid out as the strategy reads them (a slice, the whole, or random summands of a partial sum), the node in
its row's local form for that rank, and the pieces must be the full op's output laid out as the strategy
says.  No process group is needed: a rule that proposes anything inexact fails here.
"""

from __future__ import annotations

import operator
from dataclasses import replace

import pytest
import torch

from autotp.ops.strategies import Context, input_slots, needs_grad, token_inputs
from autotp.ops.table import TABLE, op
from autotp.passes.hints import with_hints
from autotp.passes.prepared_graph import prepared_graph
from autotp.placement import Disjoint, Partial, Replicate, Shard, take_local
from autotp.planning.candidates import enumerate_strategies
from tests.helpers.op_samples import SAMPLES as PLAIN_SAMPLES
from tests.helpers.op_samples_typed import TYPED_SAMPLES

SAMPLES = {**PLAIN_SAMPLES, **TYPED_SAMPLES}

aten = torch.ops.aten


def _values(gm: torch.fx.GraphModule, inputs: tuple) -> dict:
    """Every node's full value on the inputs as the node made it, and under (node, input) each input as the node
    read it: a write in place in between (``copy_`` into a view) changes what later readers read."""
    values, live = {}, {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            for src in node.all_input_nodes:
                values[(node, src)] = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, live[src])
            live[node] = super().run_node(node)
            values[node] = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, live[node])
            return live[node]

    Recorder(gm).run(*inputs)
    return values


def _piece(value, placement, rank: int, world: int, rng: torch.Generator):
    """A rank's local value of a full ``value`` laid out as ``placement``."""
    if isinstance(placement, tuple):
        return type(value)(_piece(v, p, rank, world, rng) for v, p in zip(value, placement, strict=True))
    if isinstance(placement, Shard):
        return take_local(value, placement, rank, world)
    if isinstance(placement, Partial):  # random summands, the same on every simulated rank (seeded per value)
        state = rng.get_state()
        others = [
            torch.randn(value.shape, dtype=value.dtype, generator=rng)
            if value.is_floating_point() or value.is_complex()
            else torch.randint(-9, 9, value.shape, dtype=value.dtype, generator=rng)
            for _ in range(world - 1)
        ]
        rng.set_state(state)
        return value - sum(others) if rank == 0 else others[rank - 1]
    return value


def _local_output(
    gm: torch.fx.GraphModule, node: torch.fx.Node, strategy, values: dict, rank: int, world: int, rng: torch.Generator
):
    """``node`` run as ``rank`` under ``strategy``: a one-node program in the op's local form for that rank."""
    graph, env, feed = torch.fx.Graph(), {}, []
    wants = dict(zip(input_slots(node), strategy.inputs, strict=True))
    for src in node.all_input_nodes:
        want = wants.get(src)
        whole = want is None or isinstance(want, Replicate)
        if whole and (src.op == "get_attr" or src.target == aten.lift_fresh_copy.default):  # a constant: kept as is
            env[src] = graph.node_copy(src, lambda a: graph.get_attr(a.target))
        else:
            env[src] = graph.placeholder(src.name)
            feed.append(_piece(values[(node, src)], want, rank, world, rng))
        env[src].meta = dict(src.meta)
    copy = graph.node_copy(node, env.__getitem__)
    graph.output(copy)
    program = torch.fx.GraphModule(gm, graph)
    local = op(node.target).local
    if local is not None:
        local(copy, strategy, rank, world)
        program.recompile()
    return program(*feed)


def _expected(full, placement, rank: int, world: int):
    if isinstance(placement, tuple):
        return [_expected(v, p, rank, world) for v, p in zip(full, placement, strict=True)]
    return take_local(full, placement, rank, world) if isinstance(placement, Shard) else full


def _check(node, strategy, outputs: list, full, world: int) -> None:
    where = f"{node.name} ({node.target}) {[str(p) for p in strategy.inputs]} -> {strategy.output}"
    placements = strategy.output if isinstance(strategy.output, tuple) else (strategy.output,)
    fulls = full if isinstance(strategy.output, tuple) else (full,)
    for k, (placement, whole) in enumerate(zip(placements, fulls, strict=True)):
        pieces = [out[k] if isinstance(strategy.output, tuple) else out for out in outputs]
        low = {"atol": 0.05, "rtol": 0.05} if whole.dtype == torch.bfloat16 else {}  # summands rounded in bf16
        if isinstance(placement, Partial):
            torch.testing.assert_close(sum(pieces), whole, msg=lambda m: f"{where}: {m}", **low)
            continue
        for rank, piece in enumerate(pieces):
            expected = _expected(whole, placement, rank, world)
            if "uninitialized" in op(node.target).tags:  # no values yet (new_empty): its pieces' shapes
                assert piece.shape == expected.shape, f"{where}, rank {rank}: {piece.shape} != {expected.shape}"
                continue
            torch.testing.assert_close(piece, expected, msg=lambda m, r=rank: f"{where}, rank {r}: {m}")


def _has_disjoint(strategy) -> bool:
    flat = [*strategy.inputs, *(strategy.output if isinstance(strategy.output, tuple) else (strategy.output,))]
    return any(isinstance(p, Disjoint) for p in flat)


def _candidates(gm: torch.fx.GraphModule, world: int) -> dict:
    """Every node's strategies at ``world`` ranks, sequence parallelism offered (no expert segments)."""
    ctx = with_hints(gm, Context(world=world, tokens=True, ops=TABLE))
    ctx = replace(ctx, grad=frozenset(needs_grad(gm)), token_symbols=frozenset(token_inputs(gm.graph)))
    return enumerate_strategies(gm, ctx).strategies


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    return {
        name: (prepared_graph(make(), args), args) for name, (make, inputs) in SAMPLES.items() for args in [inputs()]
    }


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("name", list(SAMPLES))
def test_every_strategy_of_every_row_is_exact_rank_by_rank(captured, name, world):
    gm, args = captured[name]
    values = _values(gm, args)
    checked = 0
    for node, options in _candidates(gm, world).items():
        if node.op != "call_function":
            continue
        for strategy in options:
            if strategy.replicated or _has_disjoint(strategy) or strategy.output is None:
                continue  # whole experts (disjoint rows) are checked by test_moe.py on real ranks
            rng = torch.Generator().manual_seed(checked)
            outputs = [_local_output(gm, node, strategy, values, r, world, rng) for r in range(world)]
            _check(node, strategy, outputs, values[node], world)
            checked += 1
    assert checked > 0


def test_every_row_with_a_rule_is_exercised(captured):
    """Adding a row means adding a use of it above: each op with a rule appears in some sample with a sharded
    strategy proposed for it at some world size."""
    proposed = set()
    for gm, _ in captured.values():
        for world in (2, 3, 4):
            proposed |= {
                str(n.target) for n, options in _candidates(gm, world).items() if any(not s.replicated for s in options)
            }
    ruled = {str(target) for target, row in TABLE.items() if row.rule is not None}
    assert ruled - proposed == set()


def test_rows_agree_with_the_schemas():
    """What a row says of aliasing matches PyTorch's schema, except where the table says why (a copy unless
    already contiguous, a cast that copies), and every layout op is a view or a lookup (``w[ids]``) or cast."""
    from autotp.ops.semantics import may_alias

    for target, row in TABLE.items():
        if isinstance(target, torch._ops.OpOverload) and row.view:
            assert may_alias(target), target
        if row.layout:
            assert row.view or row.family in ("index", "elementwise"), target
    assert op(aten.flatten.using_ints).view and op(aten.numpy_T.default).view and op(aten.broadcast_to.default).view
    assert op(operator.getitem).view and not op(aten.contiguous.default).view


def test_a_repeat_over_tokens_copies_no_heads():
    """A repeat over the sequence (a symbolic size: MRA, ProphetNet and Llama 4 repeat so) gives no KV-head hint,
    and its graph is planned; it used to fail hashing the symbolic size."""
    from autotp.passes.hints import repeat_hints
    from autotp.planning.tensor_plan import solve_plan

    class Repeated(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

        def forward(self, x):
            return self.down(self.up(x).repeat(1, 2, 1))

    gm = prepared_graph(Repeated(), (torch.randn(2, 5, 8),), None)
    assert any(n.target == aten.repeat.default for n in gm.graph.nodes)
    assert repeat_hints(gm) == {}
    assert solve_plan(gm, 2).nodes


def test_tiled_kv_heads_are_split_block_by_block(captured):
    """KV heads repeated tiled (query head i reads KV head i % 2 of 6) are one ``repeat``; at 2 ranks the copies
    are 3 blocks of 2 heads split alike, so the product reading them, the query's rotary (an unbind) and the query
    projection's rows are offered the same blocks, and each rank reads its own KV head (no KV head gathered)."""
    gm, _ = captured["einsums"]
    candidates = _candidates(gm, 2)
    (repeat,) = [n for n in gm.graph.nodes if n.target == aten.repeat.default]
    blocks = Shard(1, (2, 2, 2))
    assert any(s.output == blocks and tuple(s.inputs) == (Shard(1),) for s in candidates[repeat]), candidates[repeat]
    (product,) = [n for n in repeat.users if n.target == aten.einsum.default]
    assert any(s.output == blocks for s in candidates[product]), candidates[product]
    unbound = [n for n in gm.graph.nodes if n.target == aten.unbind.int]
    assert unbound and any(s.output[0] == blocks for s in candidates[unbound[0]])
    # at 3 ranks (more than the KV heads) each rank's 2 query heads read both: the KV value held whole (its
    # gradient summed), each rank repeating its slice of the copies
    at_three = _candidates(gm, 3)[repeat]
    assert any(s.output == Shard(1) and isinstance(s.inputs[0], Shard) and s.inputs[0].whole(3) for s in at_three)
