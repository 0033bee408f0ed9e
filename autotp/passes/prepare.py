"""Graph preparation before rules: split biases off matmuls, find fused projections."""
from __future__ import annotations

import torch
from torch.fx import Node

from autotp.ops.semantics import may_alias, writes, written
from autotp.ops.table import op

aten = torch.ops.aten


def merge_aliases(gm: torch.fx.GraphModule) -> None:
    """One get_attr node per tensor: tied weights (GPT-2's wte = lm_head) get a single placement."""
    first: dict = {}
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        tensor = getattr_path(gm, node.target)
        if not node.users:
            gm.graph.erase_node(node)
        elif id(tensor) in first:
            node.replace_all_uses_with(first[id(tensor)])
            gm.graph.erase_node(node)
        else:
            first[id(tensor)] = node
    gm.graph.lint()


def drop_no_ops(gm: torch.fx.GraphModule) -> None:
    """Remove what only costs dispatch time at run time and hides the graph's structure from the rules:
    torch.export's dtype/device assertions, casts to the dtype a tensor already has (``to`` without copy
    returns its input; ``x.type_as(y)`` is such a cast that reads ``y`` for its dtype only), copies into contiguous
    memory that no reader needs (``_any_layout``) and slices of everything (``x[:, :, a:b]`` slices dims 0 and 1
    whole first)."""
    for node in list(gm.graph.nodes):
        if node.target == aten.type_as.default:
            node.target, node.args = aten.to.dtype, (node.args[0], node.args[1].meta["val"].dtype)
        if node.target == aten._assert_tensor_metadata.default and not node.users:
            gm.graph.erase_node(node)
        elif node.target == aten.slice.Tensor and len(node.args) <= 4 and _whole(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        elif node.target == aten.contiguous.default and len(node.args) == 1 and not node.kwargs and _any_layout(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        elif node.target == aten.to.dtype and len(node.args) == 2 and not node.kwargs:
            source, out = node.args[0].meta.get("val"), node.meta.get("val")
            if isinstance(source, torch.Tensor) and isinstance(out, torch.Tensor) and source.dtype == out.dtype:
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
    gm.graph.lint()


def spell_out_sizes(gm: torch.fx.GraphModule) -> None:
    """x.reshape_as(y) -> x.reshape(y's sizes), x.view_as(y) -> x.view(...): the view rules read sizes, not a tensor
    that only lends its shape (RoFormer's rotary); a dynamic size is read from y with sym_size."""
    spelled = {aten.reshape_as.default: aten.reshape.default, aten.view_as.default: aten.view.default}
    for node in list(gm.graph.nodes):
        if node.target not in spelled or not isinstance(node.args[1], Node):
            continue
        like = node.args[1]
        sizes = []
        for d, size in enumerate(like.meta["val"].shape):
            if isinstance(size, torch.SymInt):
                with gm.graph.inserting_before(node):
                    size_node = gm.graph.call_function(aten.sym_size.int, (like, d))
                size_node.meta = {**node.meta, "val": size}
                size = size_node
            sizes.append(size)
        node.target, node.args = spelled[node.target], (node.args[0], sizes)
    gm.graph.lint()
    gm.recompile()


def _any_layout(node: Node) -> bool:
    """Every reader of ``node`` takes it in any memory layout (no ``view``, nothing writes into it or a view of it): a
    ``contiguous`` before them changes no value, and whether it is captured at all depends on the device (the meta
    device's attention output is laid out otherwise than the CPU's), so a plan made on meta would not apply."""
    return bool(node.users) and not written(node) and all(
        user.op == "call_function" and "strided" not in op(user.target).tags for user in node.users)


def out_of_place(gm: torch.fx.GraphModule) -> None:
    """An in-place op on a new tensor that no other view shares -> its out-of-place twin, read by what comes after it
    (Falcon's ``mlp_output += attention_output``; DeBERTa's softmax output zeroed by ``masked_fill_``, which autograd
    refuses: softmax's backward reads the output it overwrote).  The same values, one less write for the rules."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.name.endswith("_") or not node.args:
            continue
        x = node.args[0]
        twin = getattr(getattr(aten, schema.name.split("::")[-1][:-1], None), schema.overload_name or "default", None)
        if twin is None or not isinstance(x, Node) or not _unseen(x) or not writes(node, x) \
                or any(user.op != "call_function" or may_alias(user.target) for user in x.users):
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(twin, node.args, node.kwargs)
        new.meta = dict(node.meta)
        order[new] = order[node]
        node.replace_all_uses_with(new)
        x.replace_all_uses_with(new, delete_user_cb=lambda user, at=order[node]: order.get(user, -1) > at)
        gm.graph.erase_node(node)
    gm.graph.lint()


def drop_zero_bias(gm: torch.fx.GraphModule) -> None:
    """baddbmm(zeros, a, b, alpha=k) -> bmm(a, b) * k (GPT-NeoX-Japanese starts its scores from a zeros tensor of
    [batch * heads, s, s]): a bmm of heads merged with the batch is what unmerge rewrites on [batch, heads, ...]."""
    for node in list(gm.graph.nodes):
        zero = node.args[0] if node.target == aten.baddbmm.default else None
        if not isinstance(zero, Node) or "zeros" not in op(zero.target).tags:
            continue
        alpha = node.args[4] if len(node.args) > 4 else node.kwargs.get("alpha", 1)
        with gm.graph.inserting_before(node):
            product = gm.graph.call_function(aten.bmm.default, tuple(node.args[1:3]))
            product.meta = dict(node.meta)
            if alpha != 1:
                product = gm.graph.call_function(aten.mul.Tensor, (product, alpha))
                product.meta = dict(node.meta)
        node.replace_all_uses_with(product)
        gm.graph.erase_node(node)
        if not zero.users:
            gm.graph.erase_node(zero)


def _fresh(node: Node) -> bool:
    """A tensor an op made anew (its schema says it aliases no input), not an input, parameter or view."""
    return node.op == "call_function" and not may_alias(node.target)


def _unseen(node: Node) -> bool:
    """A new tensor, or a view of one that nothing else reads, each base read by the view on it alone (Funnel's
    ``scores[..., :n] *= mask``): a write into it shows only through the in-place op's result."""
    while node.op == "call_function" and may_alias(node.target) and node.args and isinstance(node.args[0], Node):
        if len(node.args[0].users) != 1:
            return False
        node = node.args[0]
    return _fresh(node)


def call(graph: torch.fx.Graph, target, args: tuple, like: Node, kwargs: dict | None = None) -> Node:
    """A new node computing ``target``, its value from its operands' (``like``'s other metadata)."""
    made = graph.call_function(target, args, kwargs or {})
    values = [[v.meta["val"] if isinstance(v, Node) else v for v in a] if isinstance(a, (list, tuple)) else
              a.meta["val"] if isinstance(a, Node) else a for a in args]
    made.meta = {**like.meta, "val": target(*values, **(kwargs or {}))}
    return made


def getattr_path(gm: torch.nn.Module, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def split_bias(gm: torch.fx.GraphModule) -> None:
    """linear(x, w, b) -> linear(x, w) + b, addmm(b, x, w) -> mm(x, w) + b and conv(x, w, b, ...) ->
    conv(x, w, None, ...) + b[:, None, ...].

    A row-split matmul (a conv over split input channels) yields partial sums; the bias must be added once: by one
    rank to the partial sums (strategies.adds_once) or after they are reduced.
    """
    for node in list(gm.graph.nodes):
        bias_shape = None
        if node.target == aten.linear.default and len(node.args) > 2 and node.args[2] is not None:
            x, w, b = node.args
            matmul_args = (x, w)
            target = aten.linear.default
        elif node.target == aten.addmm.default and not node.kwargs:
            b, x, w = node.args
            matmul_args = (x, w)
            target = aten.mm.default
        elif op(node.target).family == "convolution" and len(node.args) > 2 and isinstance(node.args[2], Node):
            b, target = node.args[2], node.target
            matmul_args = (*node.args[:2], None, *node.args[3:])
            bias_shape = [-1] + [1] * (node.meta["val"].dim() - 2)  # channels first: [C, 1, ...]
        else:
            continue
        with gm.graph.inserting_before(node):
            product = gm.graph.call_function(target, matmul_args, dict(node.kwargs))
            if bias_shape is not None:
                column = gm.graph.call_function(aten.view.default, (b, bias_shape))
                column.meta = {**node.meta, "val": b.meta["val"].view(bias_shape)}
                b = column
            total = gm.graph.call_function(aten.add.Tensor, (product, b))
        for new in (product, total):
            new.meta = dict(node.meta)
        node.replace_all_uses_with(total)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


def unflatten_products(gm: torch.fx.GraphModule) -> None:
    """view(x, [-1, h]) -> mm(., w) [+ b] -> view(., [*lead, n])  =>  matmul(x, w) [+ b] (GPT-2's Conv1D).

    Flattening tokens into rows hides the sequence dim from the product: a sequence-split input must then
    be gathered before the flattening view, and its gradient summed by an all-reduce after it, where
    Megatron-SP reduce-scatters.  The same product on the unflattened input keeps the dims visible.
    """
    graph = gm.graph
    for flat in list(graph.nodes):
        if op(flat.target).family != "view":
            continue
        x = flat.args[0]
        if not isinstance(x, Node) or len(flat.users) != 1 or not _flattens_rows(x, flat):
            continue
        mm = next(iter(flat.users))
        if mm.target != aten.mm.default or mm.args[0] is not flat or len(mm.users) != 1:
            continue
        tail, last = [mm], next(iter(mm.users))
        if last.target == aten.add.Tensor and last.args[0] is mm and _is_vector(last.args[1]) and len(last.users) == 1:
            tail, last = [mm, last], next(iter(last.users))
        if op(last.target).family != "view":
            continue
        out = last.meta.get("val")
        if not isinstance(out, torch.Tensor) or tuple(out.shape[:-1]) != tuple(x.meta["val"].shape[:-1]):
            continue
        with graph.inserting_before(last):
            value = graph.call_function(aten.matmul.default, (x, mm.args[1]))
            value.meta = {**mm.meta, "val": out}
            if len(tail) == 2:
                value = graph.call_function(aten.add.Tensor, (value, tail[1].args[1]))
                value.meta = {**tail[1].meta, "val": out}
        last.replace_all_uses_with(value)
        for node in (last, *reversed(tail), flat):
            graph.erase_node(node)
    graph.lint()
    gm.recompile()


def _flattens_rows(x: Node, flat: Node) -> bool:
    src, dst = x.meta.get("val"), flat.meta.get("val")
    return (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.dim() >= 3 and dst.dim() == 2
            and src.shape[-1] == dst.shape[-1])


def _is_vector(node) -> bool:
    return isinstance(node, Node) and isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].dim() == 1


def fuse_repeat_kv(gm: torch.fx.GraphModule) -> None:
    """reshape(expand(x.unsqueeze(d + 1)), merging d and d + 1) -> x.repeat_interleave(n, d).

    This is how grouped-query attention repeats KV heads; as one op it can be sharded by heads
    even when ranks outnumber KV heads (ops/rules.py: repeat_interleave).
    """
    for node in list(gm.graph.nodes):
        if op(node.target).family != "view":
            continue
        expanded = _skip_noop_slices(node.args[0])
        if expanded.target != aten.expand.default:
            continue
        unsqueezed = _skip_noop_slices(expanded.args[0])
        if unsqueezed.target != aten.unsqueeze.default:
            continue
        x = unsqueezed.args[0]
        big, out, src = (list(map(str, n.meta["val"].shape)) for n in (expanded, node, x))
        at = unsqueezed.args[1] % len(big) - 1
        if at < 0 or big[:at + 1] + big[at + 2:] != src or not big[at + 1].isdigit() or not src[at].isdigit():
            continue
        repeats = int(big[at + 1])
        if out != [*big[:at], str(int(src[at]) * repeats), *big[at + 2:]]:
            continue
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(aten.repeat_interleave.self_int, (x, repeats, at))
        fused.meta = dict(node.meta)
        node.replace_all_uses_with(fused)
        dead = node
        while dead is not x and not dead.users:  # the chain back to x, unless something else reads it
            source = dead.args[0]
            gm.graph.erase_node(dead)
            dead = source
    gm.graph.lint()
    gm.recompile()


def _skip_noop_slices(node):
    while node.target == aten.slice.Tensor and len(node.args) <= 4 and _whole(node):
        node = node.args[0]
    return node


def _whole(node) -> bool:
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else None
    return start in (0, None) and (end is None or (isinstance(end, int) and end >= 2 ** 62))
