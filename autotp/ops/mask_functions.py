"""A BlockMask's ``mask_mod`` as input structure, not as an object: training loops build a mask per batch
(``and_masks(causal, same_document(doc_ids))``), a new closure each call, and the captured program must accept it.

Two mask functions are the same when their code objects are (recursively, through the functions their closures
hold) and their closures' other values are equal; the tensors their closures hold (the document ids) are leaves,
inputs the program reads on every call, never constants baked into the capture.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch


class _Leaf:
    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _Leaf()  # where a leaf sits in a skeleton


@dataclass(frozen=True)
class FunctionShape:
    """A Python function by what it computes: its code, its closure's and defaults' skeletons (tensors replaced
    by ``_TENSOR``, functions by their own shapes).  ``template`` is a function to rebuild from (its globals and
    name); it does not take part in equality."""

    code: types.CodeType
    cells: tuple
    defaults: tuple
    template: types.FunctionType = field(compare=False, repr=False)

    def __repr__(self) -> str:  # no address: input specs are compared and shown across processes
        return f"{self.code.co_qualname}{self.cells!r}" if self.cells else self.code.co_qualname


def _skeleton(value, leaves: list):
    """``value`` with its tensors moved to ``leaves``; functions (closures) as FunctionShapes."""
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return _TENSOR
    if isinstance(value, types.FunctionType):
        return function_shape(value, leaves)
    if type(value) in (tuple, list):
        return type(value)(_skeleton(v, leaves) for v in value)
    return value


def function_shape(function, leaves: list):
    """The shape of ``function``, its closure's tensors appended to ``leaves``; a callable that is not a plain
    Python function (a builtin, a partial) is its own shape, compared as an object."""
    if not isinstance(function, types.FunctionType):
        return function
    cells = tuple(_skeleton(_content(cell), leaves) for cell in function.__closure__ or ())
    defaults = _skeleton(tuple(function.__defaults__ or ()), leaves)
    return FunctionShape(function.__code__, cells, defaults, function)


_EMPTY = object()  # a closure cell not yet assigned


def _content(cell):
    try:
        return cell.cell_contents
    except ValueError:
        return _EMPTY


def _build(skeleton, leaves):
    if skeleton is _TENSOR:
        return next(leaves)
    if isinstance(skeleton, FunctionShape):
        return rebuild(skeleton, leaves)
    if type(skeleton) in (tuple, list):
        return type(skeleton)(_build(v, leaves) for v in skeleton)
    return skeleton


def rebuild(shape, leaves):
    """The function ``shape`` describes, reading its tensors from the iterator ``leaves`` in flattening order."""
    if not isinstance(shape, FunctionShape):
        return shape
    cells = tuple(
        types.CellType() if v is _EMPTY else types.CellType(v) for v in (_build(c, leaves) for c in shape.cells)
    )
    template = shape.template
    function = types.FunctionType(
        shape.code, template.__globals__, template.__name__, _build(shape.defaults, leaves) or None, cells or None
    )
    function.__kwdefaults__ = template.__kwdefaults__
    function.__qualname__ = template.__qualname__
    return function
