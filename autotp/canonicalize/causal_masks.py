"""A causal mask computed from sizes alone, as attention's ``is_causal``; a mask of all true, none.

    before: m = le(index(arange(s), ...), index(arange(s), ...)) & ...;  a = scaled_dot_product_attention(q, k, v, m)
    after:  a = scaled_dot_product_attention(q, k, v, is_causal=True)

transformers passes ``is_causal=True`` in eager mode but builds its mask as a tensor when traced (its
packed-sequence check cannot run on a tracer), so a captured LLaMA, Qwen or GPT-2 carries a batch x 1 x s x s
mask: built on every call, converted to floats inside each attention call and saved per layer for the backward,
and on CUDA it rules out flash attention.  The rewrite proves, never guesses: it evaluates every element of the
mask as a formula of its indices (sympy) and drops the mask only when that formula is ``key index <= query
index`` for every size (or true: an encoder's mask without padding).  A mask that reads any input tensor
(padding, document ids, positions), a buffer, or an op this evaluator does not know stays as it is; so does a
sliding window.
Test: tests/test_causal_masks.py.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import NamedTuple

import sympy
import torch
from torch.fx import Node
from torch.fx.operator_schemas import normalize_function

from autotp.canonicalize.graph_edits import erase_unused

aten = torch.ops.aten
INDEX = [sympy.Symbol(f"i{d}", integer=True, nonnegative=True) for d in range(8)]  # a tensor's element indices


class Unknown(Exception):
    """The evaluator cannot say what an element is: the mask stays."""


class Result(NamedTuple):
    """What an op makes, as its rule needs to know before evaluating it."""

    shape: tuple
    dtype: torch.dtype


class Formula:
    """A tensor as one formula of its element's indices (``INDEX[d]`` along dim d), its shape and dtype."""

    __slots__ = ("dtype", "expr", "shape")

    def __init__(self, expr, shape: tuple, dtype: torch.dtype):
        if len(shape) > len(INDEX):
            raise Unknown("too many dims")
        self.expr, self.shape, self.dtype = sympy.sympify(expr), tuple(shape), dtype

    def at(self, indices: list) -> sympy.Basic:
        """The element at ``indices`` (formulas of some other tensor's indices), one per dim."""
        return self.expr.xreplace(dict(zip(INDEX[: len(indices)], indices, strict=True)))

    def broadcast(self, shape: tuple) -> sympy.Basic:
        """This tensor's element as broadcast to ``shape``, in that shape's indices."""
        lead = len(shape) - len(self.shape)
        return self.at([0 if n == 1 and shape[lead + d] != 1 else INDEX[lead + d] for d, n in enumerate(self.shape)])


def causal_masks(gm: torch.fx.GraphModule) -> None:
    """Attention whose boolean mask is provably ``key <= query`` at every size: ``is_causal=True``, no mask; one
    provably true everywhere (an encoder's mask without padding): no mask."""
    dropped, proofs = [], {}  # every layer reads the same mask: proved once
    for node in gm.graph.nodes:
        if node.target != aten.scaled_dot_product_attention.default:
            continue
        bound = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
        mask = bound["attn_mask"]
        if isinstance(mask, Node) and mask not in proofs:
            proofs[mask] = _proved(mask)
        found = proofs[mask] if isinstance(mask, Node) and not bound["is_causal"] else None
        if found is None:
            continue
        node.args = (bound["query"], bound["key"], bound["value"])
        kept = {k: v for k, v in bound.items() if k not in ("query", "key", "value", "attn_mask")}
        node.kwargs = {**kept, "is_causal": found == "causal"}
        dropped.append(mask)
    erase_unused(gm.graph, dropped, also=OPS)  # the mask and what only it read
    gm.graph.lint()
    gm.recompile()


def _proved(mask: Node) -> str | None:
    """ "causal" or "everything" where the mask's formula is proved so, else None."""
    value = mask.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dtype != torch.bool or value.dim() < 2:
        return None
    try:
        found = sympy.simplify(evaluate(mask, {}).expr)  # key - 1 <= query - 1: key <= query
    except Exception:  # Unknown, or a form no rule here expects: the mask stays, which is right
        return None
    if found is sympy.true:
        return "everything"
    query, key = INDEX[value.dim() - 2], INDEX[value.dim() - 1]
    return "causal" if _at_most_zero(found) == key - query else None


def _at_most_zero(found) -> sympy.Basic | None:
    """An integer comparison as ``d <= 0`` (``a < b``: ``a - b + 1 <= 0``), d expanded; None for anything else."""
    sides = {sympy.Le: (1, 0), sympy.Lt: (1, 1), sympy.Ge: (-1, 0), sympy.Gt: (-1, 1)}.get(type(found))
    if sides is None or not (found.lhs - found.rhs).is_integer:
        return None
    sign, strict = sides
    return sympy.expand(sign * (found.lhs - found.rhs) + strict)


def evaluate(node, seen: dict):
    """``node``'s value: a sympy number for a size or scalar, a Formula for a tensor; Unknown if it depends on
    anything but sizes (``seen`` memoizes)."""
    if not isinstance(node, Node):
        if isinstance(node, (bool, int, float)):
            return sympy.sympify(node)
        raise Unknown(f"argument {node!r}")
    if node in seen:
        return seen[node]
    value = node.meta.get("val")
    if isinstance(value, (torch.SymInt, torch.SymBool, int, bool)):  # a size: its formula over the shape symbols
        found = sympy.sympify(value.node.expr if isinstance(value, (torch.SymInt, torch.SymBool)) else value)
    elif not isinstance(value, torch.Tensor) or node.op != "call_function" or node.target not in OPS:
        raise Unknown(f"{node.name} ({node.target})")
    else:
        args = [_arg(a, seen) for a in node.args]
        kwargs = {k: _arg(v, seen) for k, v in node.kwargs.items()}
        out = Result(_shape(value), value.dtype)
        found = Formula(OPS[node.target](*args, **kwargs, out=out), out.shape, out.dtype)
    seen[node] = found
    return found


def _arg(a, seen: dict):
    if isinstance(a, (list, tuple)):
        return [None if x is None else evaluate(x, seen) for x in a]
    if a is None or isinstance(a, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return a
    return evaluate(a, seen)


def _shape(value: torch.Tensor) -> tuple:
    return tuple(sympy.sympify(s.node.expr if isinstance(s, torch.SymInt) else s) for s in value.shape)


def _element(x, out: Result):
    """An operand of an elementwise op, broadcast to the result's shape: a Formula's element, or a scalar."""
    return x.broadcast(out.shape) if isinstance(x, Formula) else x


def _number(e):
    """A boolean used as a number (a sum of booleans): 1 or 0."""
    if e is sympy.true or e is sympy.false:
        return sympy.Integer(e is sympy.true)
    if _truth(e):
        return sympy.Piecewise((1, e), (0, True))
    return e


def _truth(e) -> bool:
    """A true/false formula (sympy's symbols count as booleans too; an index is not one)."""
    return isinstance(e, (sympy.logic.boolalg.BooleanAtom, sympy.logic.boolalg.BooleanFunction, sympy.Rel))


def _elementwise(f: Callable, logic: bool) -> Callable:
    """An elementwise op; ``logic``: and/or/not, taken on booleans only (on integers they are bitwise), else
    arithmetic or a comparison, whose result is no boolean but for comparisons (a sum of booleans saturates)."""

    def rule(*args, out, alpha=1, **kwargs):
        if alpha != 1 or kwargs:
            raise Unknown("an elementwise op with options")
        if logic and not all(a.dtype == torch.bool for a in args if isinstance(a, Formula)):
            raise Unknown("a bitwise op on integers")
        found = f(*(_element(a, out) for a in args))
        if (out.dtype == torch.bool) != (logic or _truth(found) or isinstance(found, sympy.logic.boolalg.BooleanAtom)):
            raise Unknown("arithmetic on booleans")
        return found

    return rule


def _arithmetic(f: Callable) -> Callable:
    return _elementwise(lambda *a: f(*map(_number, a)), logic=False)


def _compare(f: Callable) -> Callable:
    return _elementwise(lambda a, b: f(_number(a), _number(b)), logic=False)


def _logic(f: Callable) -> Callable:
    return _elementwise(f, logic=True)


def _arange(*args, out, **kwargs):
    start, _, step = (0, args[0], 1) if len(args) == 1 else (*args, 1)[:3]  # the end: the shape's
    if not (sympy.sympify(start).is_integer and sympy.sympify(step).is_integer):
        raise Unknown("a range of fractions")
    return start + step * INDEX[0]


def _filled(value: int) -> Callable:
    def rule(*args, out, **kwargs):
        return sympy.sympify(bool(value)) if out.dtype == torch.bool else value

    return rule


def _unsqueeze(x: Formula, dim, out) -> sympy.Basic:
    dim = int(dim) % len(out.shape)
    return x.at([INDEX[d] if d < dim else INDEX[d + 1] for d in range(len(x.shape))])


def _expand(x: Formula, sizes, out, implicit=False) -> sympy.Basic:
    return x.broadcast(out.shape)


def _same(x: Formula, *args, out, **kwargs) -> sympy.Basic:
    """A copy, or a cast between dtypes of one kind (boolean, integer, floating), of the same shape: the same
    elements (a float cast of integer formulas is not taken: it may round)."""
    if x.shape != out.shape or _kind(x.dtype) != _kind(out.dtype):
        raise Unknown("a cast or view that changes the shape or kind")
    return x.expr


def _kind(dtype: torch.dtype) -> tuple:
    return dtype == torch.bool, dtype.is_floating_point, dtype.is_complex


def _slice(x: Formula, dim=0, start=None, end=None, step=1, *, out) -> sympy.Basic:
    dim = int(dim) % len(out.shape)
    if start is not None and start.is_negative is not False:
        raise Unknown("a slice from a negative start")
    begin = 0 if start is None else start
    return x.at([begin + step * INDEX[d] if d == dim else INDEX[d] for d in range(len(x.shape))])


def _diff(x: Formula, n=1, dim=-1, prepend=None, append=None, *, out) -> sympy.Basic:
    """``x[k] - x[k - 1]``, the first element less ``prepend``'s (one element along ``dim``)."""
    dim = int(dim) % len(out.shape)
    if n != 1 or append is not None or prepend is None or prepend.shape[dim] != 1 or x.shape != out.shape:
        raise Unknown("diff other than once with one prepended element")
    k = INDEX[dim]
    earlier = x.at([k - 1 if d == dim else INDEX[d] for d in range(len(out.shape))])
    at_start = (x.expr - prepend.broadcast(out.shape)).xreplace({k: 0})
    return sympy.Piecewise((at_start, sympy.Eq(k, 0)), (x.expr - earlier, True))


def _cumsum(x: Formula, dim, dtype=None, *, out) -> sympy.Basic:
    """A running sum along ``dim`` of what does not vary along it (anything else is not evaluated)."""
    k = INDEX[int(dim) % len(out.shape)]
    term = _number(x.expr)
    if k in term.free_symbols:
        raise Unknown("a running sum of what varies along it")
    return term * (k + 1)


def _index(x: Formula, indices, *, out) -> sympy.Basic:
    """Advanced indexing with integer index tensors in consecutive dims (broadcast together where they stand)."""
    used = [d for d, i in enumerate(indices) if i is not None]
    if not used or used != list(range(used[0], used[-1] + 1)):
        raise Unknown("index tensors apart")
    first, taken = used[0], len(used)
    picked = len(out.shape) - (len(x.shape) - taken)  # the dims the broadcast index tensors make
    region = out.shape[first : first + picked]
    if any(indices[d].dtype == torch.bool or indices[d].expr.is_nonnegative is not True for d in used):
        raise Unknown("a boolean index, or one that may count from the end")
    shifted = [INDEX[first + d] for d in range(picked)]

    def picked_at(d: int) -> sympy.Basic:
        element = indices[d].broadcast(region)
        return element.xreplace(dict(zip(INDEX[:picked], shifted, strict=False)))

    kept_after = [INDEX[first + picked + d] for d in range(len(x.shape) - first - taken)]
    return x.at([*INDEX[:first], *(picked_at(d) for d in used), *kept_after])


def _triangle(upper: bool) -> Callable:
    """tril / triu: the elements on and below (above) diagonal ``k`` of the last two dims, zeros elsewhere."""

    def rule(x: Formula, k=0, *, out) -> sympy.Basic:
        row, col = INDEX[len(out.shape) - 2], INDEX[len(out.shape) - 1]
        kept = sympy.Ge(col - row, k) if upper else sympy.Le(col - row, k)
        if x.dtype == torch.bool:
            return sympy.And(x.expr, kept)
        return sympy.Piecewise((x.expr, kept), (0, True))

    return rule


def _full(size, value, *, out, **kwargs):
    return sympy.sympify(bool(value)) if out.dtype == torch.bool else value


def _where(cond, a, b, *, out):
    return sympy.Piecewise((_element(a, out), _element(cond, out)), (_element(b, out), True))


OPS: dict = {
    aten.arange.default: _arange,
    aten.arange.start: _arange,
    aten.arange.start_step: _arange,
    aten.new_ones.default: lambda x, size, **k: _filled(1)(**k),
    aten.new_zeros.default: lambda x, size, **k: _filled(0)(**k),
    aten.ones.default: lambda size, **k: _filled(1)(**k),
    aten.full.default: _full,
    aten.tril.default: _triangle(upper=False),
    aten.triu.default: _triangle(upper=True),
    aten.zeros.default: lambda size, **k: _filled(0)(**k),
    aten.add.Tensor: _arithmetic(operator.add),
    aten.sub.Tensor: _arithmetic(operator.sub),
    aten.mul.Tensor: _arithmetic(operator.mul),
    aten.le.Tensor: _compare(sympy.Le),
    aten.le.Scalar: _compare(sympy.Le),
    aten.lt.Tensor: _compare(sympy.Lt),
    aten.lt.Scalar: _compare(sympy.Lt),
    aten.ge.Tensor: _compare(sympy.Ge),
    aten.ge.Scalar: _compare(sympy.Ge),
    aten.gt.Tensor: _compare(sympy.Gt),
    aten.gt.Scalar: _compare(sympy.Gt),
    aten.eq.Tensor: _compare(sympy.Eq),
    aten.eq.Scalar: _compare(sympy.Eq),
    aten.ne.Tensor: _compare(sympy.Ne),
    aten.ne.Scalar: _compare(sympy.Ne),
    aten.__and__.Tensor: _logic(sympy.And),
    aten.bitwise_and.Tensor: _logic(sympy.And),
    aten.logical_and.default: _logic(sympy.And),
    aten.__or__.Tensor: _logic(sympy.Or),
    aten.bitwise_or.Tensor: _logic(sympy.Or),
    aten.logical_or.default: _logic(sympy.Or),
    aten.bitwise_not.default: _logic(sympy.Not),
    aten.logical_not.default: _logic(sympy.Not),
    aten.where.self: _where,
    aten.unsqueeze.default: _unsqueeze,
    aten.expand.default: _expand,
    aten.slice.Tensor: _slice,
    aten.diff.default: _diff,
    aten.cumsum.default: _cumsum,
    aten.index.Tensor: _index,
    aten.to.dtype: _same,
    aten.to.dtype_layout: _same,
    aten._to_copy.default: _same,
    aten.clone.default: _same,
    aten.alias.default: _same,
    aten.contiguous.default: _same,
}
