"""One capture per test instead of one per rank: the ranks of a test build the same models from the same seeds,
and torch.export's dynamic capture of each is about two thirds of the suite's time on two cores.

``capture_first(build)`` runs in the process the ranks are forked from (``run_ranks(..., captures=build)``): it
captures the models ``build()`` returns, as a rank's ``autotp.parallelize`` would, and leaves a hook in autotp's
capture that answers a capture of an identical model and inputs with a copy of the one already made.  Identical
means the same module tree, attributes, parameter and buffer values, input structure, shapes and dtypes; anything
else is captured as usual, so a hook that misses costs time, never correctness."""
from __future__ import annotations

import copy
import hashlib
import os
import pickle
import warnings

import torch
from torch.utils._pytree import tree_flatten

import autotp.parallel.split
import autotp.passes.capture
import autotp.passes.prepared_graph
from autotp.passes.capture import register_inputs

_capture = autotp.passes.capture.capture
_made: dict[str, torch.fx.GraphModule] = {}
_SKIP = {"_parameters", "_buffers", "_modules"}
_LOG = os.environ.get("SHARED_CAPTURE_LOG")
_leading = False


def _tensor(t: torch.Tensor, values: bool = True) -> bytes:
    head = f"{tuple(t.shape)}:{t.dtype}:{t.device.type}:{t.requires_grad}:{isinstance(t, torch.nn.Parameter)}:"
    if t.is_meta or not values:  # a capture sees inputs as fake tensors: their values cannot shape it
        return head.encode()
    return head.encode() + t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def digest(model: torch.nn.Module, args, kwargs) -> str | None:
    """What a capture depends on; None where some of it cannot be read (then it is captured as usual)."""
    h = hashlib.sha256(f"{torch.is_grad_enabled()}:{torch.get_default_dtype()}".encode())
    try:
        register_inputs(args, kwargs or {})  # as capture does first: a BlockMask or a dataclass input is a pytree
        for name, module in model.named_modules(remove_duplicate=False):
            state = vars(module)
            h.update(pickle.dumps((name, type(module).__module__, type(module).__qualname__,
                                   [(k, state[k]) for k in sorted(state) if k not in _SKIP])))
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            h.update(name.encode() + _tensor(t))
        leaves, spec = tree_flatten((tuple(args), dict(kwargs or {})))
        h.update(str(spec).encode())
        for x in leaves:
            h.update(_tensor(x, values=False) if isinstance(x, torch.Tensor) else pickle.dumps(x))
    except Exception:  # an attribute that does not pickle (a lambda, a lock): capture as usual
        return None
    return h.hexdigest()


def shared_capture(model: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> torch.fx.GraphModule:
    """In the leader (``capture_first``), capture and keep the original; in a rank, a copy of it, or a capture as
    usual when there is none or the copy would differ from it."""
    key = digest(model, args, kwargs)
    served = copy_of(_made[key]) if key in _made else None
    if _LOG:  # SHARED_CAPTURE_LOG=FILE: each capture's pid and whether it was served (to check a test's list)
        with open(_LOG, "a") as log:
            log.write(f"{os.getpid()} {'served' if served is not None else 'made'}\n")
    if served is not None:
        return served
    gm = _capture(model, args, kwargs)
    if _leading and key is not None:
        _made[key] = gm
        copied = copy_of(gm)
        return copied if copied is not None else _capture(model, args, kwargs)
    return gm


def copy_of(gm: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """A deep copy that keeps export's lifted constants (a KV cache, tensors the forward creates) plain attributes
    (GraphModule's deepcopy registers every tensor a get_attr names as a buffer); None if it still differs from
    ``gm`` in its parameters, buffers or tensor attributes."""
    with warnings.catch_warnings():  # copying a graph module's tree specs warns of a deprecated LeafSpec check
        warnings.simplefilter("ignore", FutureWarning)
        copied = copy.deepcopy(gm)
    for name, module in gm.named_modules(remove_duplicate=False):
        twin = copied.get_submodule(name)
        twin._non_persistent_buffers_set = set(module._non_persistent_buffers_set)  # the deepcopy forgets them
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and attr in twin._buffers:
                tensor = twin._buffers.pop(attr)
                twin._non_persistent_buffers_set.discard(attr)
                setattr(twin, attr, tensor)
    return copied if _layout(copied) == _layout(gm) else None


def _layout(gm: torch.fx.GraphModule) -> list:
    """Where each tensor sits; a subgraph (FlexAttention's score function) is a GraphModule whatever it was named."""
    return [(name, "GraphModule" if isinstance(m, torch.fx.GraphModule) else type(m).__name__, sorted(m._parameters),
             sorted(m._buffers), sorted(m._non_persistent_buffers_set),
             sorted(k for k, v in vars(m).items() if isinstance(v, torch.Tensor)))
            for name, m in gm.named_modules(remove_duplicate=False)]


def capture_first(build) -> None:
    """Install the hook, then capture what ``build()`` returns: (model, args) pairs."""
    global _leading
    for module in (autotp.passes.capture, autotp.passes.prepared_graph, autotp.parallel.split):
        assert module.capture in (_capture, shared_capture), f"{module.__name__} no longer captures: hook its caller"
        module.capture = shared_capture
    _leading = True
    for model, args in build():
        autotp.passes.prepared_graph.prepared_graph(model, args)
    _leading = False  # the ranks forked from here serve copies and keep what they capture to themselves
