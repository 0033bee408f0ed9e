"""Capture: torch.export (non-strict) to an ATen-level fx graph with dynamic sizes."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import logging
import re
import traceback
import types
import warnings
from pathlib import Path

import torch
from torch.export import Dim, ShapesCollection
from torch.fx.node import map_arg
from torch.utils._pytree import SUPPORTED_NODES, tree_leaves, tree_map

from autotp.ops.flex import exportable_on_cpu, mask_tensors, register_block_mask
from autotp.ops.table import drops, op
from autotp.passes.canonical_order import canonical_order
from autotp.passes.faithful import check_faithful
from autotp.runtime import kernels
from autotp.runtime.quantized import stored_quantized


class CaptureError(RuntimeError):
    pass


def _dynamic_shapes(model: torch.nn.Module, args: tuple, kwargs: dict):
    """Every dim of every tensor input is AUTO: dynamic unless the trace pins it (hidden sizes); a BlockMask's block
    tables keep their sizes (ops/flex.py).  Inputs may be any registered pytree (dataclasses, NamedTuples)."""
    tables = mask_tensors(args, kwargs)
    shapes = ShapesCollection()
    for x in tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor) and id(x) not in tables:
            shapes[x] = dict.fromkeys(range(x.dim()), Dim.AUTO)
    return shapes.dynamic_shapes(model, args, kwargs)


def _through_var_keyword(model: torch.nn.Module, kwargs: dict) -> list:
    """Keyword inputs ``model.forward`` takes through ``**kwargs`` (a vision tower handed the text's input_ids)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return []
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return []
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return [k for k in kwargs if k not in named]


def register_inputs(args, kwargs) -> None:
    """Dataclasses among the inputs become pytrees (torch.export.register_dataclass: every field a child), as does
    the BlockMask: the sharded model keeps the model's signature."""
    register_block_mask()
    while True:
        leaves = tree_leaves((args, kwargs))
        found = {type(x) for x in leaves if dataclasses.is_dataclass(x) and not isinstance(x, type)}
        found -= set(SUPPORTED_NODES)
        if not found:
            return
        for cls in found:
            torch.export.register_dataclass(cls, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")


def _on_model_device(model: torch.nn.Module, tree):
    device = next((p.device for p in model.parameters()), None)
    if device is None or device.type != "meta":
        return tree
    return tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, tree)


def _standalone(tree):
    """Views among the example inputs copied into tensors of their own: torch.export guards a view input on its
    base (``x._base.size()``), so a graph captured from ``tokens[:, :-1]`` would fail on any input that is not a
    view, as every tensor pipelining's stages receive (detached, or received from another rank)."""
    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) and x._base is not None else x, tree)


_SUPPORTED = {torch.float32, torch.float16, torch.bfloat16, torch.float64}
_COMPLEX = {torch.complex64, torch.complex128}  # buffers only (rotation tables e^(i t f)): pairs of a supported dtype


def check_inputs(model: torch.nn.Module, args, kwargs) -> None:
    """Clear errors for what torch.export would reject obscurely."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"autotp needs a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(
            f"example args must be a tuple of the forward's positional inputs, got "
            f"{type(args).__name__}: write (x,) for a single input"
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"example kwargs must be a dict of keyword inputs, got {type(kwargs).__name__}")
    buffers = dict(model.named_buffers())
    complex_buffers = [name for name, b in buffers.items() if b.dtype in _COMPLEX]
    stored = stored_quantized(model)  # the tensors quantized products read as stored, and only those
    for name, tensor in [*model.named_parameters(), *buffers.items()]:
        if (tensor.dtype in _COMPLEX and name in buffers) or (name in stored and not tensor.requires_grad):
            continue
        if name in stored:  # asks for a gradient: a weight stored quantized is never trained
            raise TypeError(f"{name} is stored quantized ({tensor.dtype}) and cannot be trained: freeze it")
        if tensor.is_complex():
            why = (
                "complex tensors are sharded as buffers (rotation tables), not as parameters"
                if tensor.dtype in _COMPLEX
                else "keep complex buffers in complex64 or complex128"
            )
            raise TypeError(f"{name} has dtype {tensor.dtype}: {why}; keep this part outside the model autotp shards")
        if (tensor.is_floating_point() and tensor.dtype not in _SUPPORTED) or tensor.is_quantized:
            raise TypeError(
                f"{name} has dtype {tensor.dtype}: autotp shards float32, bfloat16, float16 and float64 "
                f"models (and complex64/128 buffers); {_advice(complex_buffers)}"
            )


def _advice(complex_buffers: list) -> str:
    """How to convert: never ``model.to(dtype)`` where that casts a complex buffer to a real dtype (PyTorch keeps
    the real part only, with a warning, and the model runs on, wrong)."""
    if not complex_buffers:
        return "convert the model (model.to(torch.bfloat16)) or keep this part outside"
    return (
        f"convert its parameters only (model.to(dtype) would cast the complex buffer {complex_buffers[0]} to a "
        "real dtype and drop its imaginary part): e.g. build the model in bfloat16 and compute the complex table "
        "in float32 afterwards, or keep this part outside"
    )


class _Specialized(logging.Filter):
    """Keeps export's "dimension inputs[...] 0/1 specialized" log lines (one per dim, on every capture) for autotp
    to say once in its own words; the logger's other lines pass."""

    def __init__(self):
        super().__init__()
        self.dims: list = []

    def filter(self, record: logging.LogRecord) -> bool:
        found = re.match(r"dimension (\S+) 0/1 specialized.*hint = (\d+)", record.getMessage())
        if found:
            self.dims.append(f"{found.group(1)} at {found.group(2)}")
        return not found or logging.getLogger("autotp").isEnabledFor(logging.DEBUG)


@contextlib.contextmanager
def _specialized_dims():
    """The dims export fixed at a size of 0 or 1, its own log lines about them held back."""
    logger, held = logging.getLogger("torch._export.non_strict_utils"), _Specialized()
    logger.addFilter(held)
    try:
        yield held.dims
    finally:
        logger.removeFilter(held)


def capture(model: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> torch.fx.GraphModule:
    """An fx GraphModule of ATen ops with the model's parameter names; works on meta models."""
    check_inputs(model, args, kwargs)
    kwargs = dict(kwargs or {})
    register_inputs(args, kwargs)
    args, kwargs = _standalone(_on_model_device(model, (tuple(args), kwargs)))
    through = _through_var_keyword(model, kwargs)  # torch.export (2.13) matches no dynamic shapes to these
    try:  # in the model's own mode: a model in training mode drops in the sharded program too
        with exportable_on_cpu(), _specialized_dims() as fixed:
            program = torch.export.export(
                model,
                args,
                kwargs,
                dynamic_shapes=None if through else _dynamic_shapes(model, args, kwargs),
                strict=False,
            )
        if through:
            warnings.warn(
                f"autotp: {', '.join(through)} reach "
                f"{type(model).__name__}.forward through **kwargs, where torch.export takes no dynamic "
                "sizes: captured at the example's sizes, other sizes get a program of their own",
                stacklevel=3,
            )
        elif fixed:
            warnings.warn(
                f"autotp: the example inputs fix {', '.join(fixed)} (torch.export makes no size of 0 or 1 "
                "dynamic): calls at other sizes get a program of their own, captured again; pass examples "
                "of at least 2 for one program of any size",
                stacklevel=3,
            )
    except Exception as exc:  # torch.export raises many kinds
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__}: {first}\n{_user_frame(exc)}"
            "autotp needs a graph it can trace: remove data-dependent Python control flow on tensor values "
            "(if/while on a tensor's value, .item(), .tolist()), or pass example inputs that match the "
            "model's forward() signature."
        ) from exc
    gm = program.module()
    check_faithful(model, program, gm, args, kwargs)
    for refused in ("train", "eval"):  # an exported module refuses both; the sharded program's dropouts follow them
        gm.__dict__.pop(refused, None)
    gm.train(model.training)
    dropping = [n for n in gm.graph.nodes if drops(n)]
    if dropping:
        mode = "training" if model.training else "eval"
        warnings.warn(
            f"{type(model).__name__} drops in the sharded model as in one process: {len(dropping)} dropout "
            f"op(s) captured in {mode} mode draw masks, each rank its part (every rank of a group must seed "
            "alike: torch.manual_seed(seed)); call model.eval() first for a model that never drops",
            stacklevel=3,
        )
    return gm


def retarget_device(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """A graph names the device it was captured on in its factory calls and checks (arange(device=meta),
    _assert_tensor_metadata(device=cpu)): point them at the one the program runs on (a model captured on meta or
    on the CPU whose shards live on a GPU)."""
    captured = (
        {torch.device("meta")}
        | {t.device for t in [*gm.parameters(), *gm.buffers()]}
        | {
            node.meta["val"].device
            for node in gm.graph.nodes
            if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor)
        }
    )
    captured.discard(device)

    def swap(value):
        if isinstance(value, torch.device) and value in captured:
            return device
        if isinstance(value, (list, tuple)):
            return type(value)(swap(v) for v in value)
        return value

    for node in gm.graph.nodes:
        node.args = swap(node.args)
        node.kwargs = {k: swap(v) for k, v in node.kwargs.items()}
        if (
            "cpu_no_integers" in op(node.target).tags
            and device.type == "cpu"
            and not node.args[0].meta["val"].is_floating_point()
        ):
            node.target = kernels.histc_of_integers  # the meta capture took the GPU branch: integers
    gm.recompile()


def _user_frame(exc: BaseException) -> str:
    """Where in the user's code the capture failed: the innermost frame outside the directories torch and autotp
    are installed in (their paths, not a folder's name: a user's project may sit in a folder named autotp)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not _in_library(f.filename)]
    if not frames:
        return ""
    f = frames[-1]
    return f"  at {f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}\n"


@functools.cache
def _library_dirs() -> tuple[Path, ...]:
    return (Path(torch.__file__).resolve().parent, Path(__file__).resolve().parents[1])  # torch's and autotp's


def _in_library(filename: str) -> bool:
    path = Path(filename).resolve()
    return any(path.is_relative_to(d) for d in _library_dirs())


def canonical_names(gm: torch.fx.GraphModule) -> None:
    """Ops renamed by their kind and canonical order (``mul``, ``mul_1``, ...; passes/canonical_order.py):
    torch.export's names count ops it traced and then dropped, which differ by device (SDPA on the meta device and
    on the CPU), and plans name the ops."""
    graph = torch.fx.Graph(owning_module=gm, tracer_cls=gm.graph._tracer_cls, tracer_extras=gm.graph._tracer_extras)
    graph._codegen = gm.graph._codegen  # the model's call signature (input and output pytrees)
    names, counts = {}, {}
    for rank, node in enumerate(canonical_order(gm.graph)):  # counted in an order of the graph alone
        name = node.name
        if node.op == "call_function":
            base = re.sub(r"_\d+$", "", name)
            counts[base] = counts.get(base, -1) + 1
            name = f"{base}_{counts[base]}" if counts[base] else base
        names[node] = name
        node.meta["autotp_rank"] = rank
    env = {}
    for node in gm.graph.nodes:  # run in the captured order
        env[node] = graph.create_node(
            node.op,
            node.target,
            map_arg(node.args, env.__getitem__),
            map_arg(node.kwargs, env.__getitem__),
            name=names[node],
            type_expr=node.type,
        )
        env[node].meta = node.meta
    gm.graph = graph


FINGERPRINT_PARTS = (
    "the ops and how they connect",
    "the ops' constant arguments (view sizes, dims, scalars)",
    "parameter and buffer shapes or dtypes",
)


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.layout, torch.memory_format)
_NAMED = (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)


def target_name(target) -> str:
    """A call target's name, the same in every process: an op's or a HOP's own name, a Python function's module
    and qualified name, never its text when that holds a memory address (``<function f at 0x...>``, a vmapped
    mask function): fingerprints and plans are compared across processes and machines."""
    if isinstance(target, _NAMED):
        return str(target)
    if isinstance(target, types.BuiltinFunctionType) and isinstance(target.__self__, types.ModuleType):
        return str(target)  # <built-in function getitem>
    if isinstance(target, functools.partial):
        return f"functools.partial({target_name(target.func)})"
    owner = target if hasattr(target, "__qualname__") else type(target)
    return f"{getattr(owner, '__module__', None) or ''}.{owner.__qualname__}".lstrip(".")


def _constants(node: torch.fx.Node) -> str:
    """A node's non-tensor arguments, the same on every rank: other objects (a device: a plan made on
    meta applies on any device; anything whose text holds a memory address) by their type's name."""
    consts = map_arg((node.args, node.kwargs), lambda _: "%")
    return str(tree_map(lambda x: x if isinstance(x, _PLAIN) else type(x).__name__, consts))


def fingerprint(gm: torch.fx.GraphModule, key=None, keep=None, seed: str = "") -> str:
    """Hashes of the graph's structure, its ops' constant arguments and its tensors' shapes, joined by
    dots: a plan is only valid for this graph, and comparing the parts says what differs (another split
    of heads x head dim changes only view sizes and buffer shapes).  ``key`` names nodes (default: their
    names) and ``keep`` selects them, for folded graphs (passes/fold.py)."""
    key = key or (lambda n: n.target if n.op == "get_attr" else n.name)
    parts = [hashlib.sha256(seed.encode()) for _ in FINGERPRINT_PARTS]
    for node in sorted(gm.graph.nodes, key=lambda n: n.meta.get("autotp_rank", 0)):  # stable: captured order
        if keep is not None and not keep(node):
            continue
        target = "" if node.op == "get_attr" else target_name(node.target)
        parts[0].update(f"{node.op}:{key(node)}:{target}:{[key(a) for a in node.all_input_nodes]};".encode())
        parts[1].update(f"{key(node)}:{_constants(node)};".encode())
        value = node.meta.get("val")
        if node.op == "get_attr" and isinstance(value, torch.Tensor):
            parts[2].update(f"{key(node)}:{tuple(value.shape)}:{value.dtype};".encode())
    return ".".join(h.hexdigest()[:8] for h in parts)


def fingerprint_difference(planned: str, found: str) -> str:
    """Which parts of two fingerprints differ, in words ("" if they cannot be compared part by part)."""
    a, b = planned.split("."), found.split(".")
    if len(a) != len(FINGERPRINT_PARTS) or len(b) != len(FINGERPRINT_PARTS):
        return ""
    return ", ".join(what for what, x, y in zip(FINGERPRINT_PARTS, a, b, strict=True) if x != y)


def within(path: str, modules) -> bool:
    """``path`` (a module's or a parameter's) is one of ``modules`` or inside one."""
    return any(path == m or path.startswith(m + ".") for m in modules)
