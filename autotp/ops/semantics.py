"""What an ATen op is, as data: the row type of the op table (ops/table.py), and the facts PyTorch's own
schemas state (which outputs may alias an input, which arguments an op writes in place).

The table's rows are read by every pass -- rules, what the backward keeps, recomputation, graph preparation,
the rewrite and pricing -- so that one place says what an op is.  This module holds no rows: the rule
modules sit between it and the table, and read other ops' rows through ``Context.op``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch.fx import Node


@dataclass(frozen=True)
class Op:
    """One op family's row.  ``rule(node, ctx)`` proposes sharded strategies (None: no rule for this use;
    the all-replicated strategy is always offered); ``keeps(node, grad)`` lists what its backward keeps as
    (input slot or None for its output, kind or None) pairs (passes/kept_tensors.py; None: every tensor input, never
    less than it keeps); ``local(node, strategy, rank,
    world)`` rewrites a node into this rank's form where a sharded op is not the same op on smaller tensors;
    ``flops(node, size)`` prices a product (others cost one FLOP per output element) and ``shape(node, held, whole)``
    gives its shape as (m, n, k, groups, ragged) from its operands' sizes as one rank holds them (``held(arg)``)
    and whole (``whole(arg)``): the product's efficiency depends on it (cost_models/compute.py)."""

    family: str = "unknown"
    rule: Callable | None = None
    view: bool = False  # the output shares input 0's storage (what it keeps is its input's)
    layout: bool = False  # the same data seen another way (or a cast): a parameter through it is still the
    #                           parameter, stored as used and never gathered at run time
    flops: Callable | None = None
    shape: Callable | None = None
    dequantizes: Callable | None = None  # node -> operations a fused kernel spends per weight element dequantizing
    #                                      its stored weight (quantized products: cost_models/compute.py)
    moves: Callable | None = None  # (node, nbytes) -> bytes read and written (None: every input and the output)
    linear: tuple = ()  # operands a partial sum may be, one at a time: the op is linear in each
    linear_if: Callable | None = None  # node -> bool: the op is linear only then (a cast to the same dtype)
    additive: bool = False  # a + b: a partial sum plus a replicated operand stays one when one rank adds it
    experts: str | None = None  # how a disjoint partial (expert rows) passes: "zeros" (maps 0 to 0), "rows"
    #                             (keeps dim 0 where it is), "combine" (two of one routing, or one with a whole)
    keeps: Callable | None = None
    local: Callable | None = None
    styles: Mapping = field(default_factory=dict)  # operand index -> {sharded dim: style} (reports)
    observer: bool = False  # reads only metadata of unsharded dims: adopts any placement, needs no choice
    drops: Callable | None = None  # node -> the probability it zeroes an element (0: it draws nothing)
    tags: frozenset = frozenset()  # named groups other passes ask about (ops/table.py's TAGS)
    dim_map: Callable | None = None  # (node, dim, blocks, ctx) -> the input dims an output dim comes from
    #                                  (ops/dim_maps.py; hints walk back through it)


UNKNOWN = Op()
UNKNOWN_VIEW = Op(view=True)


def row_of(table: Mapping, target) -> Op:
    """The row for an op; other libraries' custom ops are keyed by name (they exist once imported).  An op
    without a row is replicated; it is a view where its schema says its output aliases its input."""
    found = table.get(target) or table.get(str(target))
    if found is not None:
        return found
    return UNKNOWN_VIEW if isinstance(target, torch._ops.OpOverload) and may_alias(target) else UNKNOWN


def may_alias(target) -> bool:
    """Whether the op's output may share an input's storage, as its schema says (``Tensor(a) -> Tensor(a)``);
    ``_unsafe_view`` is a view its schema does not mark; an op without a schema (``getitem``) may."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return True
    return target is torch.ops.aten._unsafe_view.default or any(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
    )


def writes(user: Node, node: Node) -> bool:
    """``user`` writes in place into the argument ``node`` is passed as (its schema marks it ``Tensor(a!)``)."""
    schema = getattr(user.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return False
    given = {**dict(zip([a.name for a in schema.arguments], user.args, strict=False)), **user.kwargs}
    return any(
        given.get(a.name) is node and a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    )


def written(node: Node) -> bool:
    """Some op writes in place into ``node``'s value or into a view of it (not merely reads it: a KV cache's
    ``index_copy_`` writes the cache, not the new keys it is given)."""
    return any(
        writes(user, node) or (user.op == "call_function" and may_alias(user.target) and written(user))
        for user in node.users
    )


def shared_with_writes(gm) -> set:
    """Every tensor of the graph whose storage some op writes in place: the written tensor, the tensor it views,
    and every view of either.  Each reader must take such a tensor as it is placed: a copy moved to another
    placement (gathered for an op without a rule, say) would miss writes made after it, or take them alone."""
    found: set = set()
    for node in gm.graph.nodes:
        source = next((a for a in node.args if isinstance(a, Node)), None) if node.op == "call_function" else None
        if written(node) or (source in found and may_alias(node.target)):
            found.add(node)
    return found
