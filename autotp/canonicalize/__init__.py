"""Canonicalization: the rewrites that bring a captured graph into the forms the op table knows.

Each module rewrites one pattern a model family writes (its docstring shows the graph before and after, the
family and its test) into ops the table's rules read; the values stay the same.  ``REWRITES`` is their order:
a rewrite may need the forms an earlier one leaves (``addmm`` is an ``mm`` and an ``add`` once its bias is split
off, which is what the flattened products' rewrite matches).  passes/prepared_graph.prepare runs them.
"""

from __future__ import annotations

from autotp.canonicalize.causal_masks import causal_masks
from autotp.canonicalize.flattened_products import unflatten_products
from autotp.canonicalize.flattened_rows import unflatten_rows
from autotp.canonicalize.group_cuts import cuts_to_gathers
from autotp.canonicalize.in_place_ops import out_of_place
from autotp.canonicalize.inline_regions import inline_regions
from autotp.canonicalize.no_ops import drop_no_ops
from autotp.canonicalize.product_biases import split_bias
from autotp.canonicalize.repeated_kv import fuse_repeat_kv
from autotp.canonicalize.slice_fills import fills_to_cat
from autotp.canonicalize.sublayer_norms import spell_out_norms
from autotp.canonicalize.tied_weights import merge_aliases
from autotp.canonicalize.unmerge import unmerge
from autotp.canonicalize.views_as import spell_out_sizes
from autotp.canonicalize.zero_bias import drop_zero_bias

REWRITES = (
    inline_regions,  # autocast and no-grad regions: their ops in the graph
    merge_aliases,  # tied weights: one node
    spell_out_sizes,  # reshape_as / view_as: the sizes given
    split_bias,  # linear / addmm / conv with a bias: the product, then the add
    unflatten_products,  # GPT-2's Conv1D: the product on unflattened tokens
    fuse_repeat_kv,  # repeat_kv: one repeat_interleave
    drop_no_ops,  # asserts, casts to the same dtype, unneeded contiguous, whole slices: gone
    causal_masks,  # a mask built from sizes alone, proved causal: attention's is_causal
    spell_out_norms,  # a norm inside a sublayer: its statistics
    unflatten_rows,  # rows flattened for a row-wise op: kept apart
    out_of_place,  # an in-place op on a new tensor: its out-of-place twin
    drop_zero_bias,  # baddbmm from zeros: bmm
    fills_to_cat,  # a new tensor filled slice by slice: cat
    unmerge,  # heads merged with the batch: a dim again
    cuts_to_gathers,  # heads packed per group, cut inside it: gathers
)
