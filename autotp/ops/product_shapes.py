"""What the op table's product rows say of their sizes: FLOPs at concrete sizes, the (m, n, k, groups, ragged)
shape of one rank's kernel, the bytes a lookup moves and a few facts a row reads from its node."""

from __future__ import annotations

import math

# ---- FLOPs of products, at concrete sizes (``size``: a SymInt or int -> int) ----------------------------


def product_flops(node, size) -> float:
    """2 x output elements x contracted length (linear, mm, bmm, matmul; grouped matmuls: each routed row by
    its expert's matrix)."""
    out = node.meta["val"]
    return 2.0 * math.prod(size(s) for s in out.shape) * size(node.args[0].meta["val"].shape[-1])


def attention_flops(node, size) -> float:
    """Q K^T and P V: 4 x batch x heads x queries x keys x head dim (Narayanan et al. 2021)."""
    b, a, sq, d = (size(s) for s in node.args[0].meta["val"].shape)
    return 4.0 * b * a * sq * size(node.args[1].meta["val"].shape[-2]) * d


# ---- shapes of products: (m, n, k, groups, ragged) from the operands' sizes one rank holds -------------------


def linear_shape(node, held, whole) -> tuple:
    """x[..., k] @ w[n, k]^T: every leading dim of x is a row."""
    x, w = held(node.args[0]), held(node.args[1])
    return math.prod(x[:-1]), w[0], x[-1], 1, False


def matmul_shape(node, held, whole) -> tuple:
    """a[..., m, k] @ b[..., k, n]: a 2-D b takes every leading dim of a as rows; batch dims (broadcast) are the
    groups of one batched kernel."""
    a, b = held(node.args[0]), held(node.args[1])
    n = b[-1] if len(b) > 1 else 1
    if len(b) <= 2:
        return math.prod(a[:-1]), n, a[-1], 1, False
    dims = [list(a[:-2]), list(b[:-2])]
    width = max(map(len, dims))
    batch = [max(x, y) for x, y in zip(*([1] * (width - len(d)) + d for d in dims), strict=True)]
    return (a[-2] if len(a) > 1 else 1), n, a[-1], math.prod(batch), False


def grouped_shape(node, held, whole) -> tuple:
    """x[S, K] @ w[e] for the rows of each expert group: the groups this rank holds, each of the rows routed to
    one expert (S / E, routing taken as uniform); the groups run like separate products (ragged)."""
    x, w = held(node.args[0]), held(node.args[1])
    return x[0] / whole(node.args[1])[0], w[-1], x[-1], w[0], True


def attention_shape(node, held, whole) -> tuple:
    """One fused kernel over batch x heads: Q K^T and P V as one product of k = 2 x head dim."""
    b, a, sq, d = held(node.args[0])
    return sq, held(node.args[1])[-2], 2 * d, b * a, False


def lookup_bytes(node, nbytes) -> float:
    """A lookup reads the rows it returns and its indices, not the whole table: out + rows + ids."""
    return 2 * nbytes(node) + sum(nbytes(a) for a in node.all_input_nodes[1:])


def same_dtype(node) -> bool:
    """A cast to the dtype its input already has (linear then; a cast to another dtype rounds)."""
    src = node.args[0].meta.get("val")
    return src is not None and src.dtype == node.meta["val"].dtype


def attention_dropout(node) -> float:
    """Attention drops with its dropout_p (Hugging Face passes one only in training mode)."""
    return node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
