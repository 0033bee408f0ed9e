"""The op table: what each ATen op autotp knows is, in one place.

A row (ops/semantics.Op) says how the op may be sharded (its rule), whether its output is a view of its
input and whether a parameter seen through it is still the parameter, how many FLOPs a product costs, in
which operands it is linear (partial sums pass through), how it carries expert rows, what its backward keeps
and how it is rewritten for one rank.  Rules, what the backward keeps (passes/kept_tensors.py), recomputation, graph
preparation, the rewrite, reports and pricing all read it.  An op without a row is computed replicated
(always correct), keeps all its inputs for its backward and costs one FLOP per output element; adding an op
is one row, and tests/test_ops.py checks every row's strategies rank by rank.
"""

from __future__ import annotations

import math
import operator
from dataclasses import replace

import torch
from torch.fx import Node

from autotp.ops import dim_maps, local_forms
from autotp.ops.along_rules import along_dims, gather, im2col, last_dims, reduced, repeat, unfold, weight_norm
from autotp.ops.channel_rules import batch_norm, convolution
from autotp.ops.expert_rules import GROUPED_MM_FALLBACK, disjoint, grouped_mm, index, routed, squeeze, strided_slice
from autotp.ops.factory_rules import new_filled
from autotp.ops.flex import FLEX, flex_heads, global_heads, keeps_flex
from autotp.ops.keeps import (
    dropout_rate,
    keeps_attention,
    keeps_condition,
    keeps_divisor,
    keeps_index,
    keeps_input,
    keeps_mask,
    keeps_normalized,
    keeps_nothing,
    keeps_operands,
    keeps_output,
)
from autotp.ops.layout_rules import (
    as_complex,
    as_real,
    cat,
    expand,
    getitem,
    indexed,
    permute,
    slice_,
    split,
    t,
    transpose,
    unbind,
    unsqueeze,
)
from autotp.ops.paged_reads import paged_heads
from autotp.ops.product_shapes import (
    attention_dropout,
    attention_flops,
    attention_shape,
    grouped_shape,
    linear_shape,
    lookup_bytes,
    matmul_shape,
    product_flops,
    same_dtype,
)
from autotp.ops.quantized_rules import dequantize_ops, quantized_linear, quantized_shape
from autotp.ops.rules import (
    attention,
    dropout,
    einsum,
    embedding,
    linear,
    matmul,
    normalize,
    pad,
    pointwise,
    reduction,
    repeat_interleave,
    top_k,
)
from autotp.ops.semantics import Op, may_alias, row_of
from autotp.ops.view_rules import view
from autotp.runtime.paged_attention import PAGED_ATTENTION

aten = torch.ops.aten


def _with_expert_rows(rule, carries: bool):
    """A rule plus the routed rows the op may compute inside an expert segment (expert_rules.routed) and, where
    it carries them (``carries``), the disjoint partials of whole experts (expert_rules.disjoint)."""

    def both(node, ctx):
        proposed = rule(node, ctx) if rule is not None else None
        added = [*(disjoint(node, ctx) if carries else ()), *routed(node, ctx)]
        return [*(proposed or ()), *added] if added else proposed

    both.__name__ = getattr(rule, "__name__", "disjoint")
    return both


def _rows(targets, **facts) -> dict:
    """One row for ops that share every fact; a ruled row, or one that carries expert rows, gets the expert
    rules too.  ``view`` defaults to the op's schema (an output that may alias its input), where it has one."""
    if facts.get("experts") or facts.get("rule"):
        facts["rule"] = _with_expert_rows(facts.get("rule"), bool(facts.get("experts")))
    return {
        target: Op(**{"view": may_alias(target) if isinstance(target, torch._ops.OpOverload) else False, **facts})
        for target in targets
    }


# fmt: off
_COMPARISONS = [aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor, aten.gt.Tensor, aten.le.Tensor, aten.ge.Tensor,
                aten.eq.Scalar, aten.ne.Scalar, aten.lt.Scalar, aten.gt.Scalar, aten.le.Scalar, aten.ge.Scalar]

_ROWS: dict = {
    # elementwise: any output dim sharded alike in every input (broadcast dims replicated), or tokens split
    **_rows([aten.add.Tensor], family="elementwise", rule=pointwise, additive=True, experts="combine",
            keeps=keeps_nothing, local=local_forms.add_once),
    **_rows([aten.sub.Tensor], family="elementwise", rule=pointwise, additive=True, keeps=keeps_nothing,
            local=local_forms.add_once),
    **_rows([aten.mul.Tensor, aten.multiply.Tensor], family="elementwise", rule=pointwise, linear=(0, 1),
            experts="combine", keeps=keeps_operands),
    **_rows([aten.div.Tensor], family="elementwise", rule=pointwise, linear=(0,), keeps=keeps_divisor),
    **_rows([aten.mul.Scalar], family="elementwise", rule=pointwise, linear=(0,), experts="zeros",
            keeps=keeps_nothing),
    **_rows([aten.div.Scalar], family="elementwise", rule=pointwise, linear=(0,), keeps=keeps_nothing),
    **_rows([aten.add.Scalar, aten.sub.Scalar], family="elementwise", rule=pointwise, keeps=keeps_nothing),
    **_rows([aten.neg.default, aten.clone.default], family="elementwise", rule=pointwise, linear=(0,),
            experts="zeros", keeps=keeps_nothing),
    **_rows([aten.contiguous.default], family="elementwise", rule=pointwise, linear=(0,), experts="zeros",
            keeps=keeps_nothing, view=False),  # a copy unless already contiguous: counted as its own tensor
    **_rows([aten.alias.default, aten.detach.default], family="elementwise", rule=pointwise, linear=(0,),
            experts="zeros", keeps=keeps_nothing, layout=True),
    **_rows([aten.to.dtype, aten._to_copy.default], family="elementwise", rule=pointwise, linear=(0,),
            linear_if=same_dtype, experts="zeros", keeps=keeps_nothing, layout=True, view=False),  # casts copy
    **_rows([aten.to.dtype_layout, aten.to.device], family="elementwise", rule=pointwise, linear=(0,),
            linear_if=same_dtype, keeps=keeps_nothing, view=False),
    **_rows([aten.silu.default, aten.gelu.default], family="elementwise", rule=pointwise, experts="zeros",
            keeps=keeps_input),
    **_rows([aten.erf.default, aten.abs.default, aten.cos.default, aten.sin.default, aten.pow.Tensor_Scalar,
             aten.square.default, aten.softplus.default, aten.expm1.default, aten.acos.default, aten.log.default,
             aten.log2.default, aten.log1p.default, aten.log_sigmoid.default, aten.hardtanh.default,
             aten.hardsigmoid.default, aten.hardswish.default],
            family="elementwise", rule=pointwise, keeps=keeps_input),
    **_rows([aten.sign.default, aten.ceil.default, aten.floor.default, aten.round.default], family="elementwise",
            rule=pointwise, keeps=keeps_nothing),
    **_rows([aten.reciprocal.default], family="elementwise", rule=pointwise, keeps=keeps_output),
    # written in place into input 0 (a view of a placed tensor: every reader takes it as placed,
    # ops/semantics.shared_with_writes), its source split alike: each rank writes its own piece
    **_rows([aten.copy_.default], family="elementwise", rule=pointwise, keeps=keeps_nothing),
    # x.expand_as(y): x broadcast to y's shape, y's dims split alike
    **_rows([aten.expand_as.default], family="elementwise", rule=pointwise, keeps=keeps_nothing),
    **_rows([aten.rsub.Scalar, aten.zeros_like.default, aten.ones_like.default], family="elementwise",
            rule=pointwise, keeps=keeps_nothing),
    **_rows([aten.minimum.default, aten.maximum.default, aten.min.other, aten.max.other], family="elementwise",
            rule=pointwise, keeps=keeps_operands),
    **_rows([aten.where.ScalarOther], family="elementwise", rule=pointwise, keeps=keeps_condition),
    **_rows([aten.tanh.default, aten.relu.default], family="elementwise", rule=pointwise, experts="zeros",
            keeps=keeps_output),
    **_rows([aten.sigmoid.default, aten.exp.default, aten.rsqrt.default, aten.sqrt.default],
            family="elementwise", rule=pointwise, keeps=keeps_output),
    # every rank masks a whole (or partial) input alike: linear in training too (runtime/dropout.py)
    **_rows([aten.dropout.default], family="elementwise", rule=dropout, linear=(0,), keeps=keeps_mask,
            drops=dropout_rate, local=local_forms.dropout),
    **_rows([aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor], family="elementwise",
            rule=pointwise, keeps=keeps_condition),
    **_rows([aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default],
            family="elementwise", rule=pointwise, keeps=keeps_input),
    **_rows(_COMPARISONS, family="elementwise", rule=pointwise, keeps=keeps_nothing),
    # products
    **_rows([aten.linear.default], family="linear", rule=linear, flops=product_flops, shape=linear_shape,
            keeps=keeps_operands, styles={1: {0: "column", 1: "row"}}),
    # quantized weights (runtime/quantized_ops.py): split at whole blocks, groups and packed words, scales alike
    **_rows([torch.ops.autotp.fp8_block_linear.default], family="quantized_linear", rule=quantized_linear,
            flops=product_flops, shape=quantized_shape, dequantizes=dequantize_ops, keeps=keeps_nothing,
            styles={1: {0: "column", 1: "row"}}),
    **_rows([torch.ops.autotp.int4_group_linear.default], family="quantized_linear", rule=quantized_linear,
            flops=product_flops, shape=quantized_shape, dequantizes=dequantize_ops, keeps=keeps_nothing,
            styles={1: {1: "column", 0: "row"}}),
    **_rows([aten.mm.default], family="matmul", rule=matmul, flops=product_flops, shape=matmul_shape,
            keeps=keeps_operands, styles={1: {1: "column", 0: "row"}}),
    **_rows([aten.matmul.default], family="matmul", rule=matmul, flops=product_flops, shape=matmul_shape,
            keeps=keeps_operands),
    **_rows([aten.einsum.default], family="einsum", rule=einsum, keeps=keeps_operands),
    **_rows([aten.bmm.default], family="matmul", rule=matmul, flops=product_flops, shape=matmul_shape,
            keeps=keeps_operands, experts="combine"),
    **_rows([aten._grouped_mm.default, GROUPED_MM_FALLBACK], family="grouped_mm", rule=grouped_mm,
            flops=product_flops, shape=grouped_shape, local=local_forms.own_experts),
    **_rows([aten.scaled_dot_product_attention.default], family="attention", rule=attention,
            flops=attention_flops, shape=attention_shape, keeps=keeps_attention, drops=attention_dropout,
            local=local_forms.attention),
    **_rows([FLEX], family="attention", rule=flex_heads, flops=attention_flops, shape=attention_shape,
            keeps=keeps_flex, local=global_heads),
    **_rows([PAGED_ATTENTION], family="attention", rule=paged_heads, keeps=keeps_flex),
    **_rows([aten.conv1d.default, aten.conv2d.default, aten.conv1d.padding, aten.conv2d.padding],
            family="convolution", rule=convolution, keeps=keeps_operands, local=local_forms.depthwise_groups),
    **_rows([aten.embedding.default], family="embedding", rule=embedding, keeps=keeps_nothing, moves=lookup_bytes,
            local=local_forms.vocab_rows, styles={0: {1: "hidden split", 0: "vocab split"}}),
    **_rows([aten.repeat_interleave.self_int], family="repeat", rule=repeat_interleave, keeps=keeps_nothing,
            local=local_forms.repeat_interleave),
    # reductions and normalizations
    **_rows([aten.sum.dim_IntList], family="reduction", rule=reduction, keeps=keeps_nothing),
    **_rows([aten.mean.dim], family="reduction", rule=reduction, keeps=keeps_nothing, local=local_forms.partial_mean),
    **_rows([aten._softmax.default, aten.softmax.int], family="softmax", rule=normalize, keeps=keeps_output),
    **_rows([aten._log_softmax.default, aten.log_softmax.int], family="log_softmax", rule=normalize,
            keeps=keeps_output),
    **_rows([aten.layer_norm.default, aten.rms_norm.default], family="layer_norm", rule=normalize,
            keeps=keeps_normalized),
    **_rows([aten.batch_norm.default], family="batch_norm", rule=batch_norm, keeps=keeps_input),
    **_rows([aten.cumsum.default], family="scan", rule=normalize, keeps=keeps_nothing),
    **_rows([aten.max.dim, aten.min.dim, aten.amax.default, aten.amin.default, aten.argmax.default,
             aten.argmin.default, aten.logsumexp.default, aten.linalg_vector_norm.default], family="reduced",
            rule=reduced, keeps=keeps_input),
    **_rows([aten.topk.default], family="scan", rule=top_k, keeps=keeps_nothing),
    **_rows([aten.pad.default, aten.constant_pad_nd.default], family="pad", rule=pad, keeps=keeps_nothing),
    # along some dims, the others passed through: gates, flips, pooling and resampling of images and signals
    **_rows([aten.glu.default], family="along", rule=along_dims, keeps=keeps_input),
    **_rows([aten.flip.default], family="along", rule=along_dims, keeps=keeps_nothing),
    **_rows([aten.tril.default, aten.triu.default], family="along", rule=last_dims(2), keeps=keeps_nothing),
    **_rows([aten.repeat.default], family="repeat", rule=repeat, keeps=keeps_nothing, local=local_forms.repeat_slice),
    **_rows([aten.unfold.default], family="unfold", rule=unfold, layout=True, keeps=keeps_nothing),
    **_rows([aten.im2col.default], family="unfold", rule=im2col, keeps=keeps_nothing),
    **_rows([aten.gather.default, aten.scatter.value, aten.scatter.src], family="gather", rule=gather,
            keeps=keeps_index),
    **_rows([aten.avg_pool2d.default, aten.adaptive_avg_pool2d.default], family="pool", rule=last_dims(2),
            keeps=keeps_input),
    **_rows([aten.avg_pool1d.default, aten.adaptive_avg_pool1d.default], family="pool", rule=last_dims(1),
            keeps=keeps_input),
    **_rows([aten.upsample_nearest2d.vec, aten.upsample_bilinear2d.vec, aten.upsample_bicubic2d.vec],
            family="resample", rule=last_dims(2), keeps=keeps_nothing),
    **_rows([aten.upsample_nearest1d.vec, aten.upsample_linear1d.vec], family="resample", rule=last_dims(1),
            keeps=keeps_nothing),
    **_rows([aten._weight_norm.default], family="weight_norm", rule=weight_norm, keeps=keeps_input),
    # layout: the same data seen another way
    **_rows([aten.view.default, aten.reshape.default, aten._unsafe_view.default], family="view", rule=view,
            layout=True, keeps=keeps_nothing, local=local_forms.resize),
    **_rows([aten.flatten.using_ints], family="view", rule=view, layout=True, keeps=keeps_nothing),
    **_rows([aten.unflatten.int], family="view", rule=view, layout=True, keeps=keeps_nothing,
            local=local_forms.unflatten),
    **_rows([aten.view_as_complex.default], family="complex", rule=as_complex, layout=True, keeps=keeps_nothing),
    **_rows([aten.view_as_real.default], family="complex", rule=as_real, layout=True, keeps=keeps_nothing),
    **_rows([aten.expand.default, aten.broadcast_to.default], family="expand", rule=expand, layout=True,
            keeps=keeps_nothing, local=local_forms.resize),
    **_rows([aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default],
            family="factory", rule=new_filled, keeps=keeps_nothing, local=local_forms.resize),
    **_rows([aten.transpose.int], family="transpose", rule=transpose, layout=True, keeps=keeps_nothing),
    **_rows([aten.t.default, aten.numpy_T.default], family="t", rule=t, layout=True, keeps=keeps_nothing),
    **_rows([aten.permute.default], family="permute", rule=permute, layout=True, keeps=keeps_nothing),
    **_rows([aten.unsqueeze.default], family="unsqueeze", rule=unsqueeze, layout=True, experts="rows",
            keeps=keeps_nothing),
    **_rows([aten.squeeze.dim], family="squeeze", rule=squeeze, layout=True, experts="rows", keeps=keeps_nothing),
    **_rows([aten.squeeze.default, aten.squeeze.dims], family="squeeze", keeps=keeps_nothing),
    **_rows([aten.unbind.int], family="unbind", rule=unbind, keeps=keeps_nothing),
    **_rows([aten.slice.Tensor], family="slice", rule=strided_slice, layout=True, experts="rows",
            keeps=keeps_nothing, local=local_forms.cut_block),
    **_rows([aten.select.int], family="slice", rule=slice_, layout=True, keeps=keeps_nothing),
    **_rows([aten.index.Tensor], family="index", rule=index, layout=True, moves=lookup_bytes, local=local_forms.index),
    **_rows([aten.split.Tensor, aten.split_with_sizes.default], family="split", rule=split, experts="rows",
            keeps=keeps_nothing, local=local_forms.split),
    **_rows([aten.chunk.default], family="split", rule=split, experts="rows", keeps=keeps_nothing),
    **_rows([operator.getitem], family="getitem", rule=getitem, view=True, keeps=keeps_nothing),
    **_rows([aten.cat.default, aten.concat.default, aten.stack.default], family="cat", rule=cat, keeps=keeps_nothing),
    **_rows([aten.index_copy_.default, aten.index_copy.default, aten.index_select.default], family="indexed",
            rule=indexed, moves=lookup_bytes, keeps=keeps_nothing),
    # metadata only
    **_rows([aten.sym_size.int, aten._assert_tensor_metadata.default], family="observer", observer=True),
}

# Named groups of ops the graph passes ask about (``"copy" in op(target).tags``), each stated here once.
TAGS = {
    "sized_view": [aten.view.default, aten.reshape.default, aten._unsafe_view.default],  # (x, sizes): the full shape
    "strided": [aten.view.default, aten._unsafe_view.default],  # needs strides its input's layout allows
    "copy": [aten.contiguous.default, aten.clone.default, aten.alias.default],  # the same values as input 0
    "cut": [aten.slice.Tensor, aten.index.Tensor],  # a range or positions of input 0 along a dim
    "batched_product": [aten.bmm.default, aten.baddbmm.default],  # products over a leading batch dim
    "pure": [aten.contiguous.default, aten.clone.default, aten.alias.default, aten.repeat.default,
             aten.bmm.default],  # values of its inputs alone: unmerge erases it once nothing reads it
    "row_wise": [aten.bmm.default, operator.getitem],  # expert rows pass through in place (ops/expert_rules.py)
    "uninitialized": [aten.new_empty.default, aten.empty.memory_format],  # a new tensor of no values yet
    # every row of input 0 alike (unmerge moves a batch*heads merge past them): over the dim at args[1] ...
    "per_row_over_dim": [aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default],
    "reduces_dims": [aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default],  # (x, dims, keep)
    "zeros": [aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default],  # all zeros, of a given size
    "per_row": [aten.dropout.default, aten.to.dtype],  # ... or elementwise
    "by_number": [aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor],  # elementwise with a number
    # what hints read blocks from (passes/hints.py)
    "joins": [aten.cat.default],  # pieces joined along a dim they keep: the join's blocks walk forwards
    "halves": [aten.glu.default],  # input 0 cut in two halves along a dim, one gating the other
    "picks": [aten.select.int],  # one index of input 0 along a dim, the dim dropped
    "repeats_each": [aten.repeat_interleave.self_int],  # each index of a dim n times in place (KV heads to queries)
    "repeats_tiled": [aten.repeat.default],  # (x, copies): x copied whole along dims (tiled KV heads to queries)
    "grouped_kv": [FLEX, PAGED_ATTENTION],  # attention that reads KV heads (dim 1) grouped under its query heads
    "reads_pool": [PAGED_ATTENTION],  # attention over a KV pool held as buffers (priced there, not again)
    # a product of quantized weights: its input's whole blocks (ops/quantized_rules.block_units)
    "quantized": [torch.ops.autotp.fp8_block_linear.default, torch.ops.autotp.int4_group_linear.default],
    # what a pipeline stage keeps (split.py) and a capture retargets to the CPU (capture.py)
    "checks_dtype": [aten._assert_tensor_metadata.default],  # export's dtype/device check of a value
    "cpu_no_integers": [aten.histc.default],  # no CPU kernel for integer inputs (runtime/kernels stands in)
}
# fmt: on

# The op a stage calls to read one dim's size at run time (the rewrite, a pipeline stage's inputs).
SIZE = aten.sym_size.int


def _tagged(rows: dict, tags: dict) -> dict:
    """``rows`` with each op's tags; an op with tags and no row gets the row it would have had (row_of's)."""
    tagged = dict(rows)
    for tag, targets in tags.items():
        for target in targets:
            row = row_of(tagged, target)
            tagged[target] = replace(row, tags=row.tags | {tag})
    return tagged


# Which input dim an output dim's blocks come from (ops/dim_maps.py): by family, and where one op differs.
DIM_MAPS = {aten.bmm.default: dim_maps.bmm, aten.squeeze.dim: dim_maps.squeeze, aten.index.Tensor: dim_maps.index}


def _mapped(rows: dict) -> dict:
    return {
        target: replace(row, dim_map=DIM_MAPS.get(target, dim_maps.BY_FAMILY.get(row.family)))
        for target, row in rows.items()
    }


TABLE: dict = _mapped(_tagged(_ROWS, TAGS))


def drops(node: Node) -> bool:
    """The op draws a random mask (a dropout captured in training mode, attention with dropout_p)."""
    row = op(node.target) if node.op == "call_function" else None
    return row is not None and row.drops is not None and row.drops(node) > 0


def op(target) -> Op:
    """The row of ``target`` (an empty row, ``family="unknown"``, for ops the table does not know)."""
    return row_of(TABLE, target)


def is_product(node: Node) -> bool:
    """A matrix product (grouped ones too: each routed token's rows by its expert's matrix), or attention."""
    return node.op == "call_function" and op(node.target).flops is not None


def flops(node: Node, size) -> float:
    """FLOPs of one forward of ``node`` at concrete sizes: a product's, else one per output element."""
    row = op(node.target)
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor):
        return 0.0
    return row.flops(node, size) if row.flops else float(math.prod(size(s) for s in out.shape))


def stored_views(gm: torch.fx.GraphModule) -> set:
    """Parameters and buffers, and what layout ops make of them (``w.transpose(-2, -1)``, ``w[expert_ids]``)."""
    found: set = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr" or (op(node.target).layout and node.args and node.args[0] in found):
            found.add(node)
    return found
