"""FlexAttention (``torch.nn.attention.flex_attention``): captured on the CPU too, a ``BlockMask`` accepted as a model
input, and the captured op split by query heads like SDPA.

The op torch.export captures is ``torch.ops.higher_order.flex_attention(q, k, v, score_mod, block_mask, scale,
kernel_options, score_mod_other_buffers, mask_mod_other_buffers)`` -> (out, log-sum-exp, max), all [B, Hq, ...];
``score_mod`` and the block mask's ``mask_mod`` are subgraphs called with the head index ``h``, which on a rank that
holds query heads ``first..`` must be the global one (ALiBi slopes computed from ``h``).
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
import torch.utils._pytree as pytree
from torch.fx import Node
from torch.nn.attention import flex_attention as flex_api

from autotp.ops.mask_functions import function_shape, rebuild
from autotp.ops.strategies import Context, Strategy, is_placed
from autotp.placement import R, Shard

aten = torch.ops.aten
FLEX = torch.ops.higher_order.flex_attention
BlockMask = flex_api.BlockMask


@contextlib.contextmanager
def exportable_on_cpu():
    """While torch.export traces: flex_attention's public function refuses CPU inputs that need gradients
    ("FlexAttention does not support backward on CPU"), at trace time too, though the op it captures runs
    forward and backward on the CPU (its dense math).  Lift that one check; other devices keep it."""
    check = flex_api._validate_device

    def validate(query, key, value):
        if query.device.type != "cpu":
            check(query, key, value)

    flex_api._validate_device = validate
    try:
        with _products_of_many():
            yield
    finally:
        flex_api._validate_device = check


@contextlib.contextmanager
def _products_of_many():
    """A mask function that indexes a tensor by ``b`` and ``kv`` (transformers' padding masks) at dynamic sizes
    makes proxy tracing rebuild a product of three sizes (``2*s0*s1``) with the binary ``operator.mul``
    ("mul expected 2 arguments, got 3"): rebuild products of any length while torch.export traces."""
    import sympy
    from torch.fx.experimental.proxy_tensor import _sympy_handlers

    handlers = _sympy_handlers()
    binary = handlers.get(sympy.Mul)
    if binary is None:
        yield
        return
    handlers[sympy.Mul] = lambda *factors: functools.reduce(binary, factors)
    try:
        yield
    finally:
        handlers[sympy.Mul] = binary


def _present(mask: BlockMask) -> tuple:
    return tuple(name for name in BlockMask._TENSOR_ATTRS if getattr(mask, name) is not None)


def _flatten(mask: BlockMask):
    """Leaves: the block tables, then the tensors the mask function's closure holds (document ids)."""
    present = _present(mask)
    cells: list = []
    shape = function_shape(mask.mask_mod, cells)
    leaves = [getattr(mask, name) for name in present]
    return [*leaves, *cells], (mask.seq_lengths, mask.BLOCK_SIZE, shape, mask.dq_kv_order_spt, present)


def _unflatten(leaves, context) -> BlockMask:
    seq_lengths, block, shape, spt, present = context
    tensors = dict.fromkeys(BlockMask._TENSOR_ATTRS)
    tensors.update(zip(present, leaves[: len(present)], strict=True))
    mask_mod = rebuild(shape, iter(leaves[len(present) :]))
    return BlockMask(seq_lengths=seq_lengths, BLOCK_SIZE=block, mask_mod=mask_mod, dq_kv_order_spt=spt, **tensors)


def _flatten_with_keys(mask: BlockMask):
    leaves, context = _flatten(mask)
    present = context[-1]
    keys = [*present, *(f"mask_mod_tensor_{i}" for i in range(len(leaves) - len(present)))]
    return [(pytree.GetAttrKey(name), leaf) for name, leaf in zip(keys, leaves, strict=True)], context


def register_block_mask() -> None:
    """A BlockMask input as a pytree (PyTorch does not register it): its block tables and its mask function's
    tensors are the leaves; its lengths, block size and the mask function's code the structure
    (ops/mask_functions.py), so a mask rebuilt per batch is the same input, one of other lengths or another
    function another input structure, never computed with the traced one."""
    if BlockMask not in pytree.SUPPORTED_NODES:
        pytree.register_pytree_node(
            BlockMask,
            _flatten,
            _unflatten,
            flatten_with_keys_fn=_flatten_with_keys,
            serialized_type_name="autotp.BlockMask",
        )


def mask_tensors(args, kwargs) -> set:
    """ids of the tensors that BlockMask inputs hold (their sizes stay as given: a table's dim 1 is the heads or
    1, which the rule must know)."""
    masks = [
        x
        for x in pytree.tree_leaves((args, kwargs), is_leaf=lambda x: isinstance(x, BlockMask))
        if isinstance(x, BlockMask)
    ]
    return {id(t) for mask in masks for t in _flatten(mask)[0]}  # closure tensors too: sized by the tables


# ---- the rule ----------------------------------------------------------------------------------------


def serves(q: Shard, held, heads: int, kv: int, world: int) -> bool:
    """Every rank's query heads meet their KV heads where the kernel looks for them: local query head i reads
    local KV head i // (its query heads / its KV heads), which must be global KV head (first + i) // (Hq / Hkv)."""
    group = heads // kv
    for rank in range(world):
        ((first, count),) = q.ranges(heads, rank, world)
        start, length = held.ranges(kv, rank, world)[0] if isinstance(held, Shard) else (0, kv)
        if count == 0 or length == 0 or count % length:
            return False
        if any((first + i) // group != start + i // (count // length) for i in range(count)):
            return False
    return True


def flex_heads(node: Node, ctx: Context) -> list[Strategy] | None:
    """FlexAttention split by query heads (dim 1): k and v split alike or held for the query heads each rank
    computes (grouped KV heads, see ``serves``); the block mask's tables split where they have one head per
    query head, else read whole (they broadcast); the buffers its functions read stay whole (indexed by the
    global head).  Outputs (out, log-sum-exp, max) split alike."""
    q, k, v, _, block_mask = node.args[:5]
    heads = ctx.shape(q)[1]
    tables = [t for t in block_mask if isinstance(t, Node) and is_placed(t)]
    reads = head_reads(node, q, k, v, ctx)
    if reads is None:
        return None
    found = []
    for s, held in reads:
        placements = {q: s, k: held, v: held}
        placements.update({t: s if len(ctx.shape(t)) > 1 and ctx.shape(t)[1] == heads else R for t in tables})
        found.append(Strategy(ctx.fill(node, placements), tuple(s for _ in node.meta["val"])))
    return found


def head_reads(node: Node, q: Node, k: Node, v: Node, ctx: Context) -> list | None:
    """(the query heads' split, how k and v [..., kv heads on dim 1, ...] are held) for an attention kernel
    that reads grouped KV heads itself (``serves``); None, with the reason noted, where no split serves."""
    heads, kv = ctx.shape(q)[1], ctx.shape(k)[1]
    if not (ctx.static(heads) and ctx.static(kv)) or heads % kv or ctx.shape(v)[1] != kv:
        return []
    found = []
    for s in ctx.shard_options(q, 1):
        if s.chunks is not None:
            continue
        options = [*(o for o in ctx.shard_options(k, 1) if o.chunks is None), R]
        for held in options:
            if not serves(s, held, heads, kv, ctx.world) or (v is not k and held not in [*ctx.shard_options(v, 1), R]):
                continue
            found.append((s, held))
    if not found and ctx.world > 1:
        ctx.why[node] = (
            f"no split of its {heads} query heads on {ctx.world} ranks meets its {kv} KV heads where the "
            "kernel reads them: computed whole, q, k and v gathered"
        )
        return None
    return found


def keeps_flex(node: Node, grad) -> list:
    """Its backward keeps q, k and v (and its output and log-sum-exp, read here through the outputs' users)."""
    return [(0, None), (1, None), (2, None)]


# ---- this rank's form ------------------------------------------------------------------------------------


def global_heads(node: Node, strategy, rank: int, world: int) -> None:
    """The score and mask functions see this rank's first query head as head ``first``, not 0."""
    placement = strategy.inputs[0]
    if not isinstance(placement, Shard):
        return
    ((first, _),) = placement.ranges(node.args[0].meta["val"].shape[1], rank, world)
    if not first:
        return
    args = list(node.args)
    args[3] = _offset(node, args[3], 2, first)  # score_mod(score, b, h, q_idx, kv_idx, *buffers)
    block_mask = list(args[4])
    block_mask[-1] = _offset(node, block_mask[-1], 1, first)  # mask_mod(b, h, q_idx, kv_idx, *buffers)
    args[4] = tuple(block_mask)
    node.args = tuple(args)


def _offset(at: Node, function: Node, slot: int, first: int) -> Node:
    """A copy of the subgraph ``function`` names whose head index (its placeholder ``slot``) is ``h + first``,
    or ``function`` itself if it does not read the head index."""
    gm = at.graph.owning_module
    sub = getattr(gm, function.target)
    if not [n for n in sub.graph.nodes if n.op == "placeholder"][slot].users:
        return function
    sub = copy.deepcopy(sub)
    h = [n for n in sub.graph.nodes if n.op == "placeholder"][slot]
    with sub.graph.inserting_after(h):
        shifted = sub.graph.call_function(aten.add.Tensor, (h, first))
    h.replace_all_uses_with(shifted, delete_user_cb=lambda user: user is not shifted)
    sub.recompile()
    name = f"{function.target}_from_head_{first}"
    gm.add_submodule(name, sub)
    with at.graph.inserting_before(at):
        return at.graph.get_attr(name)
