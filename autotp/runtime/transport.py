"""How autotp's collectives reach c10d: the functional ops (NCCL, torch.compile), or on gloo two shortcuts; every
failure raised as a CollectiveError that names the collective, its group and the value it moves."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.fx.experimental.symbolic_shapes import guard_or_false

_c10d = torch.ops._c10d_functional


# Groups registered here (gloo, on CPU) take two shortcuts measured on local ranks:
# - tensors up to ONE_SHOT_BYTES (all pieces together) are all-gathered and summed in rank order on
#   every rank -- vLLM's "one-shot" all-reduce for small messages: gloo's ring all-reduce of a small
#   tensor takes milliseconds, an all-gather a fraction of that;
# - in eager mode the collective is issued asynchronously and waited for by polling with
#   sched_yield while this process has a core to itself: a rank blocked in wait() leaves its (virtual)
#   core idle and often wakes a scheduler tick late (~4 ms on a 2-core VM), several times per forward.
# NCCL groups and torch.compile keep the functional ops.  Without sched_getaffinity (macOS) every core
# counts; without sched_yield, or with more local ranks than cores, waits block as usual.
ONE_SHOT_BYTES = 256 * 1024


class CollectiveError(RuntimeError):
    """A collective failed or did not complete: another rank died, is stuck, or runs other code."""


@dataclass(frozen=True)
class Gloo:
    world: int
    poll: bool  # no more local ranks than cores: a yielding rank takes no core from another
    timeout: float  # the process group's, in seconds: a polled wait gives up after it, as gloo's own wait does


_gloo: dict = {}  # group name -> Gloo
_labels: dict = {}  # group name -> what the group is (a mesh dimension and its ranks), for errors
_abandoned: list = []  # works given up on: kept alive, gloo may still write into them


def _cores() -> int:
    """Cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def describe(group: dist.ProcessGroup, label: str) -> None:
    """Name ``group`` in the errors of the collectives it runs (e.g. "mesh dimension 'tp' (ranks [2, 3])")."""
    _labels[group.group_name] = label


def register(group: dist.ProcessGroup, shortcuts: bool = True) -> None:
    """``parallelize`` calls this for the group it runs on: gloo groups take the shortcuts above
    (``shortcuts=False``: the plain functional c10d ops, as DTensor runs them; benchmarks compare)."""
    if dist.get_backend(group) != "gloo" or not shortcuts:
        _gloo.pop(group.group_name, None)
        return
    world = dist.get_world_size(group)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    timeout = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    _gloo[group.group_name] = Gloo(world, hasattr(os, "sched_yield") and local <= _cores(), timeout)


def unregister(group: dist.ProcessGroup) -> None:
    """Plain collectives on ``group`` from now on, as on NCCL (to compare with code that has no shortcuts)."""
    _gloo.pop(group.group_name, None)


def enable_async_tp(group: dist.ProcessGroup, device: torch.device) -> None:
    """Inductor's micro-pipeline TP pass on (a process-wide compiler setting, as torchtitan sets it), and on CUDA
    symmetric memory for ``group``: the fused all-gather-matmul and matmul-reduce-scatter ops run over it."""
    from torch._inductor import config

    config._micro_pipeline_tp = True
    if device.type == "cuda":
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        enable_symm_mem_for_group(group.group_name)


def fusable_async_tp(asked: bool | None, group: dist.ProcessGroup, device: torch.device) -> bool | None:
    """``async_tp`` as the planner takes it: None (the planner's choice) stays None only on a CUDA group over NCCL,
    where symmetric memory runs the fused ops; elsewhere False."""
    if asked is not None:
        return asked
    return None if device.type == "cuda" and dist.get_backend(group) == "nccl" else False


def _eager_gloo(group: str) -> Gloo | None:
    gloo = _gloo.get(group)
    return None if gloo is None or torch.compiler.is_compiling() else gloo


def wait(work, gloo: Gloo) -> None:
    if gloo.poll:
        deadline = time.monotonic() + gloo.timeout
        while not work.is_completed():
            if time.monotonic() > deadline:
                _abandoned.append(work)
                raise TimeoutError(f"not complete after the process group's timeout ({gloo.timeout:.0f} s)")
            os.sched_yield()
    work.wait()  # raises the collective's error, if any; blocks at most the process group's timeout


def failed(op: str, x: torch.Tensor, where: str, exc: Exception, group: str) -> CollectiveError:
    return failure(op, f"of {x.dtype} {list(x.shape)} for {where or 'a tensor'}", group, exc)


def failure(op: str, what: str, group: str, exc: Exception) -> CollectiveError:
    """The error that says which collective, over which group, for which value, in which pass, and what to look at."""
    phase = "backward" if torch._C._current_autograd_node() is not None else "forward"
    over = f" over {_labels[group]}" if group in _labels else ""
    return CollectiveError(
        f"autotp: {op}{over} {what} ({phase}) did not complete: "
        f"another rank died, is stuck, or runs different code (look at the other ranks' output); the process "
        f"group's timeout bounds the wait (on a mesh, parallelize's timeout=; else init_process_group(timeout=...)). "
        f"Cause: {exc}"
    )


def _gathered(x: torch.Tensor, world: int, group: str) -> torch.Tensor:
    return _start_gather(x, world, group)()


def _start_gather(x: torch.Tensor, world: int, group: str) -> Callable[[], torch.Tensor]:
    gloo = _eager_gloo(group)
    if gloo is None:
        started = _c10d.all_gather_into_tensor(x, world, group)
        return lambda: _c10d.wait_tensor(started)
    out = x.new_empty(world * x.shape[0], *x.shape[1:])
    work = dist.all_gather_single(out, x, group=_resolve_process_group(group), async_op=True)
    return lambda: (wait(work, gloo), out)[1]


def all_gather(x: torch.Tensor, world: int, group: str, where: str) -> torch.Tensor:
    """Every rank's ``x`` (contiguous), concatenated along dim 0."""
    return start_all_gather(x, world, group, where)()


def start_all_gather(x: torch.Tensor, world: int, group: str, where: str) -> Callable[[], torch.Tensor]:
    """Issue ``all_gather`` now; the function returned waits for it and returns its result (eager programs issue
    a collective early where independent compute can run before its first use)."""
    try:
        finish = _start_gather(x, world, group)
    except Exception as exc:
        raise failed("all_gather", x, where, exc, group) from exc

    def waited() -> torch.Tensor:
        try:
            return finish()
        except Exception as exc:
            raise failed("all_gather", x, where, exc, group) from exc

    return waited


def all_reduce(x: torch.Tensor, group: str, where: str) -> torch.Tensor:
    """The sum over ranks, as a fresh tensor: callers may add into it in place."""
    gloo = _eager_gloo(group)  # compiled: the functional op (sizes may be symbolic)
    try:
        if gloo and x.numel() * x.element_size() * gloo.world <= ONE_SHOT_BYTES:
            return _gathered(x.reshape(-1).contiguous(), gloo.world, group).view(gloo.world, *x.shape).sum(0)
        if gloo:
            out = x.clone(memory_format=torch.contiguous_format)
            wait(dist.all_reduce(out, group=_resolve_process_group(group), async_op=True), gloo)
            return out
        return _c10d.wait_tensor(_c10d.all_reduce(x.contiguous(), "sum", group))
    except Exception as exc:
        raise failed("all_reduce", x, where, exc, group) from exc


def exchange(x: torch.Tensor, out_splits: list, in_splits: list, group: str, where: str) -> torch.Tensor:
    """``all_to_all_single``: rows ``in_splits[r]`` of ``x`` (dim 0, in rank order) go to rank r, and rank r's
    ``out_splits[r]`` rows for this rank come back, in rank order (uneven splits; no autograd)."""
    gloo = _eager_gloo(group)
    try:
        if gloo is None:
            return _c10d.wait_tensor(_c10d.all_to_all_single(x.contiguous(), out_splits, in_splits, group))
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        wait(
            dist.all_to_all_single(
                out, x.contiguous(), out_splits, in_splits, group=_resolve_process_group(group), async_op=True
            ),
            gloo,
        )
        return out
    except Exception as exc:
        raise failed("all_to_all", x, where, exc, group) from exc


def gather_rows(x: torch.Tensor, lengths: list, group: str, where: str) -> torch.Tensor:
    """Every rank's rows (rank r holds ``lengths[r]``, possibly none), concatenated in rank order (no autograd)."""
    pieces = all_gather(pad(x, max(lengths)).contiguous(), len(lengths), group, where).chunk(len(lengths))
    return torch.cat([p[:n] for p, n in zip(pieces, lengths, strict=True)])


def pad(x: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad dim 0 to ``length`` (compiled, rows counted on the device are padded whatever their number)."""
    if guard_or_false(x.shape[0] == length):
        return x
    return torch.cat([x, x.new_zeros(length - x.shape[0], *x.shape[1:])])
