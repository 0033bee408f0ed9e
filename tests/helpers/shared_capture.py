"""One capture per test instead of one per rank: the ranks of a test build the same models from the same seeds,
and torch.export's dynamic capture of each is about two thirds of the suite's time on two cores.

``capture_first(build)`` runs in the process the ranks are forked from (``run_ranks(..., captures=build)``): it
captures the models ``build()`` returns, as a rank's ``autotp.parallelize`` would, and leaves a hook in autotp's
capture that answers a capture of an identical model and inputs with a copy of the one already made.  Identical
means the same module tree, attributes, parameter and buffer values, which of them are one tensor (tied weights)
or share storage, input structure, shapes and dtypes, and the same answers to what the capture read of the process
group and the environment (``torch.distributed.get_world_size()``, ``os.environ``: read in the leader, which has
no process group, and asked again in the rank).  The copy keeps torch.export's input checks (its forward hooks).
Anything else is captured as usual, so a hook that misses costs time, never correctness.

``OWN_CAPTURES`` names the builders whose tests run with every rank capturing for itself, as users' ranks do: one
case per test file that shares captures, so that what sharing could hide (a capture that changes the user's model)
still runs in the default tier (tests/test_shared_capture.py checks each file has one)."""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import os
import pickle
import warnings

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._pytree import tree_flatten

import autotp.parallel.split
import autotp.passes.capture
import autotp.passes.prepared_graph
from autotp.passes.capture import register_inputs

_capture = autotp.passes.capture.capture
_made: dict[str, tuple] = {}  # digest -> (the capture, what it read of the process group and the environment)
_SKIP = {"_parameters", "_buffers", "_modules"}
_LOG = os.environ.get("SHARED_CAPTURE_LOG")
_leading = False

# builder ("module.qualname") -> which of its calls (a test on its partial's arguments; None: all) run with every
# rank capturing on its own: the cheapest default-tier case of each file that shares captures (whose "untouched"
# and aliasing checks then see a capture made in the rank itself)
OWN_CAPTURES = {
    "tests.test_architectures._half_models": lambda dtype: dtype == torch.bfloat16,
    "tests.test_checkpoint._meta_models": None,  # test_stored_layouts.py: its mesh saves capture on their own
    "tests.test_dcp._models": None,
    "tests.test_dropout._seeded_apart_models": None,
    "tests.test_expert_checkpoints._reshard_models": None,
    "tests.test_flex._structured_examples": None,
    "tests.test_generate._sampling_captures": None,
    "tests.test_kv_layouts._examples": lambda kinds: kinds == ["llama-8-1", "falcon-101"],
    "tests.test_layouts._bloom_models": None,
    "tests.helpers.moe.six_experts_models": None,  # test_moe.py's and test_moe_dispatch.py's hand-written MoE
    "tests.test_partial_sums._models": lambda world: world == 3,
    "tests.test_quantized._quantized_models": lambda kind, directory: kind == "gptq",
    "tests.test_properties._models": lambda build, x: type(build).__name__ == "_MLP",
    "tests.test_recompute._two_ranks_models": None,
    "tests.test_sequence_parallel._two_ranks_models": None,
    "tests.test_sharded._built": lambda kind: kind == "unruly",  # _check: the user's model is untouched
    "tests.test_torch_layers._models": None,
}


def builder_name(build) -> tuple[str, tuple]:
    """("module.qualname", partial's arguments) of a ``captures=`` builder."""
    args = ()
    while isinstance(build, functools.partial):
        args, build = (*build.args, *args), build.func
    return f"{build.__module__}.{build.__qualname__}", args


def captures_own(build) -> bool:
    """Whether ``run_ranks(..., captures=build)`` runs with every rank capturing on its own (``OWN_CAPTURES``)."""
    name, args = builder_name(build)
    if name not in OWN_CAPTURES:
        return False
    which = OWN_CAPTURES[name]
    return which is None or bool(which(*args))


def _tensor(t: torch.Tensor, values: bool = True) -> bytes:
    head = (
        f"{tuple(t.shape)}:{t.stride()}:{t.dtype}:{t.device.type}:{t.requires_grad}:"
        f"{isinstance(t, torch.nn.Parameter)}:"
    )
    if t.is_meta or not values:  # a capture sees inputs as fake tensors: their values cannot shape it
        return head.encode()
    return head.encode() + t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _identities(named: list) -> bytes:
    """Which names are one tensor (tied embeddings: export keeps one parameter under the first name) and which share
    storage (views of one tensor), as the first name of each: a tied and an untied model of equal values differ."""
    same, storages, found = {}, {}, []
    for name, t in named:
        found.append(f"{name}={same.setdefault(id(t), name)}")
        if not t.is_meta and t.untyped_storage().nbytes():
            key = (t.device, t.untyped_storage().data_ptr())
            found.append(f"~{storages.setdefault(key, name)}+{t.storage_offset()}")
    return "\n".join(found).encode()


def digest(model: torch.nn.Module, args, kwargs) -> str | None:
    """What a capture depends on; None where some of it cannot be read (then it is captured as usual).  What the
    capture reads of the process group and the environment is compared apart (``_watching``, ``_same_state``)."""
    h = hashlib.sha256(f"{torch.is_grad_enabled()}:{torch.get_default_dtype()}".encode())
    try:
        register_inputs(args, kwargs or {})  # as capture does first: a BlockMask or a dataclass input is a pytree
        for name, module in model.named_modules(remove_duplicate=False):
            state = vars(module)
            h.update(
                pickle.dumps(
                    (
                        name,
                        type(module).__module__,
                        type(module).__qualname__,
                        [(k, state[k]) for k in sorted(state) if k not in _SKIP],
                    )
                )
            )
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        for name, t in named:
            h.update(name.encode() + _tensor(t))
        h.update(_identities(named))
        leaves, spec = tree_flatten((tuple(args), dict(kwargs or {})))
        h.update(str(spec).encode())
        for x in leaves:
            h.update(_tensor(x, values=False) if isinstance(x, torch.Tensor) else pickle.dumps(x))
    except Exception:  # an attribute that does not pickle (a lambda, a lock): capture as usual
        return None
    return h.hexdigest()


# the process group's state a model (or torch) can read while it is traced; is_available() is fixed by the build
_GROUP_QUERIES = (
    "is_initialized",
    "get_rank",
    "get_world_size",
    "get_backend",
    "get_process_group_ranks",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "is_torchelastic_launched",
)
_PLAIN = (bool, int, float, str, type(None))
_UNREPLAYABLE = ("unreplayable",)


def _plain(value) -> bool:
    return isinstance(value, _PLAIN) or (isinstance(value, (list, tuple)) and all(_plain(v) for v in value))


def _outcome(fn, args, kwargs):
    try:
        value = fn(*args, **kwargs)
    except Exception as exc:  # no process group: get_rank() raises
        return ("raised", type(exc).__name__)
    return ("value", str(value) if isinstance(value, str) else value) if _plain(value) else _UNREPLAYABLE


def _note(reads: list, read: tuple) -> None:
    if read not in reads:
        reads.append(read)


@contextlib.contextmanager
def _watching():
    """Record what is read of the process group (``torch.distributed``'s queries) and of ``os.environ`` while the
    leader captures: [("group", name, args, kwargs, outcome) | ("env", key, value)]."""
    reads, originals = [], {}
    for module in (dist, c10d):
        for name in _GROUP_QUERIES:
            fn = getattr(module, name, None)
            if fn is None:
                continue
            originals[module, name] = fn

            def watched(*args, _fn=fn, _name=name, **kwargs):
                plain = _plain(args) and _plain(list(kwargs.values()))
                _note(reads, ("group", _name, args, kwargs, _outcome(_fn, args, kwargs)) if plain else _UNREPLAYABLE)
                return _fn(*args, **kwargs)

            setattr(module, name, watched)
    getitem = os._Environ.__getitem__

    def read(environ, key):
        try:
            value = getitem(environ, key)
        except KeyError:
            _note(reads, ("env", key, None))
            raise
        _note(reads, ("env", key, value))
        return value

    os._Environ.__getitem__ = read
    try:
        yield reads
    finally:
        os._Environ.__getitem__ = getitem
        for (module, name), fn in originals.items():
            setattr(module, name, fn)


def _same_state(reads: list) -> bool:
    """Whether this process answers what the leader's capture read as the leader did."""
    for read in reads:
        if read[0] == "env" and os.environ.get(read[1]) != read[2]:
            return False
        if (
            read[0] == "group"
            and _outcome(getattr(c10d, read[1], None) or getattr(dist, read[1]), read[2], read[3]) != read[4]
        ):
            return False
    return True


def shared_capture(model: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> torch.fx.GraphModule:
    """In the leader (``capture_first``), capture and keep the original; in a rank, a copy of it, or a capture as
    usual when there is none, the rank would read other values of the process group or the environment, or the
    copy would differ from it."""
    key = digest(model, args, kwargs)
    made, reads = _made.get(key, (None, ()))
    served = copy_of(made) if made is not None and _same_state(reads) else None
    if _LOG:  # SHARED_CAPTURE_LOG=FILE: each capture's pid and whether it was served (to check a test's list)
        with open(_LOG, "a") as log:
            log.write(f"{os.getpid()} {'served' if served is not None else 'made'}\n")
    if served is not None:
        return served
    if not _leading:
        return _capture(model, args, kwargs)
    with _watching() as reads:
        gm = _capture(model, args, kwargs)
    if key is None or _UNREPLAYABLE in reads:
        return gm
    _made[key] = (gm, reads)
    copied = copy_of(gm)
    return copied if copied is not None else _capture(model, args, kwargs)


_HOOKS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


def copy_of(gm: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """A deep copy that keeps export's lifted constants (a KV cache, tensors the forward creates) plain attributes
    (GraphModule's deepcopy registers every tensor a get_attr names as a buffer) and export's forward hooks with
    what they read (``_check_input_constraints_pre_hook``: the input structure, ``range_constraints``,
    ``validate_inputs``; GraphModule's deepcopy drops them); None if it still differs from ``gm`` in its
    parameters, buffers, tensor attributes, attribute names or hooks."""
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
            elif attr in _HOOKS:
                setattr(twin, attr, type(value)(value))  # the same hook functions, under the same handles
            elif attr not in vars(twin):  # range_constraints, validate_inputs
                twin.__dict__[attr] = copy.deepcopy(value)
    return copied if _layout(copied) == _layout(gm) else None


def _layout(gm: torch.fx.GraphModule) -> list:
    """Where each tensor sits, which attributes and hooks each module has; a subgraph (FlexAttention's score
    function) is a GraphModule whatever it was named."""
    return [
        (
            name,
            "GraphModule" if isinstance(m, torch.fx.GraphModule) else type(m).__name__,
            sorted(m._parameters),
            sorted(m._buffers),
            sorted(m._non_persistent_buffers_set),
            sorted(k for k, v in vars(m).items() if isinstance(v, torch.Tensor)),
            sorted(vars(m)),
            [list(getattr(m, hooks).items()) for hooks in _HOOKS],
        )
        for name, m in gm.named_modules(remove_duplicate=False)
    ]


def capture_first(build) -> None:
    """Install the hook, then capture what ``build()`` returns: (model, args) pairs; nothing for a builder in
    ``OWN_CAPTURES`` (its ranks capture on their own)."""
    global _leading
    if captures_own(build):
        return
    for module in (autotp.passes.capture, autotp.passes.prepared_graph, autotp.parallel.split):
        assert module.capture in (_capture, shared_capture), f"{module.__name__} no longer captures: hook its caller"
        module.capture = shared_capture
    _leading = True
    for model, args in build():
        autotp.passes.prepared_graph.prepared_graph(model, args)
    _leading = False  # the ranks forked from here serve copies and keep what they capture to themselves
