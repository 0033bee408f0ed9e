"""One sharded program per input structure: a call whose inputs the captured program cannot take (another pytree
structure, a BlockMask of other lengths, a length one of export's shape guards excluded, such as a sequence that is
not a multiple of a state-space layer's chunk) gets a program of its own, captured and planned collectively over
the TP group, holding the first program's very parameters; or, where that is off, one line that says what differs.

Inputs are matched by structure (their pytree: types, lengths, a mask function's code), never by object: a mask
rebuilt per batch is the program's input as it was (ops/mask_functions.py)."""

from __future__ import annotations

import warnings
from collections import OrderedDict

import torch
from torch.export._tree_utils import reorder_kwargs
from torch.export._unlift import _check_input_constraints_for_module, _check_inputs_match
from torch.utils._pytree import TreeSpec, tree_flatten


class InputStructureError(ValueError):
    """A call whose inputs no program of this model takes, where autotp may not capture another."""


def _short(value, most: int = 90) -> str:
    text = repr(value)
    return text if len(text) <= most else text[: most - 3] + "..."


def _context_difference(want, got) -> str:
    if isinstance(want, (tuple, list)) and isinstance(got, (tuple, list)) and len(want) == len(got):
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            if a != b:
                return f"{_short(b)} where it had {_short(a)} (part {i} of its structure)"
    return f"{_short(got)} where it had {_short(want)}"


def _kind(spec: TreeSpec) -> str:
    return "a leaf (a tensor or value)" if spec.is_leaf() else f"a {getattr(spec.type, '__name__', spec.type)}"


def spec_difference(want: TreeSpec, got: TreeSpec, path: str = "inputs") -> str:
    """Where two input structures first differ, in words ("" where they do not)."""
    if want.type is not got.type:
        return f"{path} is {_kind(got)}, was {_kind(want)}"
    if want.context != got.context:
        return f"{path} (a {want.type.__name__}) has {_context_difference(want.context, got.context)}"
    if want.num_children != got.num_children:
        return f"{path} has {got.num_children} parts, was {want.num_children}"
    keys = want.context if isinstance(want.context, list) and len(want.context) == want.num_children else None
    for i, (a, b) in enumerate(zip(want.children(), got.children(), strict=True)):
        part = f"{path}[{keys[i]!r}]" if keys else f"{path}[{i}]"
        found = spec_difference(a, b, part)
        if found:
            return found
    return ""


def call_difference(want: TreeSpec, got: TreeSpec) -> str:
    """Where a call's (args, kwargs) differ from the captured ones: ``args[1]``, ``kwargs['mask']``."""
    if want.num_children == got.num_children == 2:
        for name, a, b in zip(("args", "kwargs"), want.children(), got.children(), strict=True):
            if a.type is dict and b.type is dict and a.context != b.context:
                return f"{name} name {sorted(b.context)}, were {sorted(a.context)}"
            if a.num_children != b.num_children:
                return f"{name} has {b.num_children} entries, had {a.num_children}"
            for i, (x, y) in enumerate(zip(a.children(), b.children(), strict=True)):
                found = spec_difference(x, y, f"{name}[{a.context[i]!r}]" if a.context else f"{name}[{i}]")
                if found:
                    return found
    return spec_difference(want, got) or "the inputs' structure differs"


def refusal(program: torch.nn.Module, args: tuple, kwargs: dict) -> str | None:
    """Why ``program`` cannot take these inputs (None if it can): their structure, or one of export's guards
    on their sizes (``_guards_fn`` runs before any op, so before any collective)."""
    spec = program._in_spec
    try:
        leaves = [x for _, x in _check_inputs_match(args, kwargs, spec)]
    except ValueError:
        return call_difference(
            spec,
            tree_flatten((args, reorder_kwargs(kwargs, spec) if set(kwargs) == set(spec.child(1).context) else kwargs))[
                1
            ],
        )
    try:
        guards = getattr(program, "_guards_fn", None)
        if guards is not None:
            guards.forward(*leaves)  # not through __call__: module hooks (CommDebugMode's) see the program's call only
        else:
            _check_input_constraints_for_module(program, args, kwargs)
    except (AssertionError, RuntimeError) as exc:
        return f"their sizes fail a guard of the capture ({str(exc).strip().splitlines()[0]})"
    return None


def share_tensors(main: torch.nn.Module, other: torch.nn.Module) -> None:
    """``other`` holds ``main``'s parameters and buffers themselves: one set of weights, trained by every call."""
    for kind, named in (("parameter", other.named_parameters), ("buffer", other.named_buffers)):
        for name, tensor in list(named(remove_duplicate=False)):
            held = main.get_parameter(name) if kind == "parameter" else main.get_buffer(name)
            if held.shape != tensor.shape:
                raise InputStructureError(
                    f"the program captured for these inputs holds {kind} {name} as "
                    f"{tuple(tensor.shape)}, the first as {tuple(held.shape)}: capture with "
                    "inputs of this structure instead"
                )
            owner, _, leaf = name.rpartition(".")
            module = other.get_submodule(owner)
            if kind == "parameter":
                module._parameters[leaf] = held
            else:
                module._buffers[leaf] = held


class Programs:
    """``main``'s forward: ``main`` for the inputs it takes, else the first of up to ``most`` other programs that
    takes them, else one ``make(args, kwargs, training)`` returns (collective over the TP group: every rank calls
    with the same structure, as the input check makes sure).  ``most=0`` refuses new structures in one line.

    A program captured in eval mode never drops (nor uses batch statistics): in training mode the call needs a
    program captured in training mode, as the model in one process would run.  (One captured in training mode
    runs eval exactly: its dropouts follow the mode, runtime/dropout.py.)"""

    def __init__(self, main: torch.nn.Module, make, most: int, why_not: str = ""):
        self.main, self.make, self.most, self.why_not = main, make, most, why_not
        self.others: OrderedDict[int, torch.nn.Module] = OrderedDict()
        self.made = 0
        main.autotp_captured_training = main.training

    def _refusal(self, program: torch.nn.Module, args, kwargs) -> str | None:
        if self.main.training and not program.autotp_captured_training:
            return "the model was captured in eval mode and now runs in training mode (where it drops)"
        return refusal(program, args, kwargs)

    def __call__(self, *args, **kwargs):
        why = self._refusal(self.main, args, kwargs)
        if why is None:  # the class's forward now: a pass after install may recompile it (FSDP units per block)
            return type(self.main).forward(self.main, *args, **kwargs)
        for key, other in self.others.items():
            if self._refusal(other, args, kwargs) is None:
                self.others.move_to_end(key)
                return self._run(other, args, kwargs)
        if self.most <= 0:
            fix = self.why_not or "pass recaptures=8 to parallelize"
            raise InputStructureError(
                f"this call's inputs differ from those the model was captured with: {why}; "
                f"{fix}, or call with inputs of that structure"
            )
        other = self.make(args, kwargs, self.main.training)
        other.autotp_captured_training = self.main.training
        self.made += 1
        self.others[self.made] = other
        if len(self.others) > self.most:
            self.others.popitem(last=False)
        warnings.warn(
            f"autotp: captured and planned the model again for a call of a new structure ({why}); "
            f"{len(self.others) + 1} programs kept, at most {self.most + 1} (option recaptures)",
            stacklevel=3,
        )
        return self._run(other, args, kwargs)

    def _run(self, other: torch.nn.Module, args, kwargs):
        share_tensors(self.main, other)  # again on every call: main's buffers may have been replaced (.to())
        if other.training != self.main.training:
            other.train(self.main.training)
        return type(other).forward(other, *args, **kwargs)


def install(main: torch.nn.Module, make, most: int, why_not: str = "") -> Programs:
    """Route ``main``'s calls through Programs; export's own input check (a pre-hook that raises on a new
    structure) gives way to it."""
    from torch.export._unlift import _check_input_constraints_pre_hook

    for key, hook in list(main._forward_pre_hooks.items()):
        if getattr(hook, "__func__", hook) is _check_input_constraints_pre_hook or (
            getattr(hook, "__name__", "") == "_check_input_constraints_pre_hook"
        ):
            del main._forward_pre_hooks[key]
            main._forward_pre_hooks_with_kwargs.pop(key, None)
    programs = Programs(main, make, most, why_not)

    def forward(*args, **kwargs):  # a function, as torch.compile expects of a GraphModule's forward
        return programs(*args, **kwargs)

    main.forward = forward
    return programs
