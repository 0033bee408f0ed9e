"""Where a group's tensors live: the device types its backends serve, never its backend's name.

A group made as "nccl" carries CUDA tensors only, "gloo" carries CPU ones (and CUDA ones, through the host), and
"cpu:gloo,cuda:nccl" each kind through its own backend.  A collective on a tensor of a device the group does not
serve fails deep inside c10d ("No backend type associated with device type cpu"), so autotp decides every
device here, from ``group._device_types``: the shards' (``shard_device``), and the host messages' group
(``host_group``: the group itself where it serves the CPU, else a gloo group over the same ranks, as vLLM keeps
a CPU group beside each device group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class DeviceError(ValueError):
    """A device the group cannot carry, or one this process does not have."""


def served(group) -> frozenset[str]:
    """The device types ``group``'s backends carry tensors of."""
    return frozenset(device.type for device in group._device_types)


def accelerator() -> torch.device | None:
    """This process's current accelerator (its GPU), or None."""
    kind = torch.accelerator.current_accelerator(check_available=True)
    return None if kind is None else torch.device(kind.type, torch.accelerator.current_device_index())


def _backend(group) -> str:
    """The group's backends as c10d names them ("cuda:nccl"), for messages."""
    if isinstance(group, dist.ProcessGroup) and dist.is_initialized():
        return dist.get_backend_config(group)
    return ",".join(sorted(served(group)))


def device_of(group) -> torch.device:
    """Where the group's collectives run: this rank's accelerator where the group serves its kind, else the CPU."""
    kinds, gpu = served(group), accelerator()
    if gpu is not None and gpu.type in kinds:
        return gpu
    if "cpu" in kinds:
        return torch.device("cpu")
    raise DeviceError(
        f"the process group's backend ({_backend(group)}) carries only {'/'.join(sorted(kinds))} "
        f"tensors and this process has no such device: run on GPUs, or init the group with a CPU "
        "backend (dist.init_process_group('gloo'), or 'cpu:gloo,cuda:nccl')"
    )


def _own_accelerator_backend(group) -> bool:
    """Whether the group carries this rank's accelerator through a backend of its own (NCCL alone, or beside gloo
    for the CPU): a GPU group, where plain gloo merely also accepts CUDA tensors."""
    gpu = accelerator()
    if gpu is None or gpu.type not in served(group):
        return False
    return "cpu" not in served(group) or group._get_backend(gpu) is not group._get_backend(torch.device("cpu"))


def graph_capturable(group, device: torch.device) -> bool:
    """Whether a CUDA graph can hold a program's kernels and its collectives over ``group`` on ``device``: a GPU
    with a backend of its own for it (NCCL); plain gloo moves CUDA tensors through the host, which no graph can
    capture.  One rank issues no collective."""
    return device.type == "cuda" and (group.size() == 1 or _own_accelerator_backend(group))


def shard_device(group, model: torch.nn.Module, device=None) -> torch.device:
    """The device this rank's shards live on, checked before any capture: ``device`` where given; else this rank's
    GPU where the group has a backend of its own for it (NCCL, "cpu:gloo,cuda:nccl": a CPU model's pieces are
    moved); else the model's own where the group serves it; else ``device_of(group)`` (a model on the meta
    device).  One rank runs no collective, so any device serves it."""
    world = group.size()
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type not in served(group) and world > 1:
            raise DeviceError(
                f"device={str(device)!r}, but the process group's backend ({_backend(group)}) carries "
                f"no {device.type} tensors: pass a device it serves ({', '.join(sorted(served(group)))})"
                " or init the group with a backend for it"
            )
        return device
    if _own_accelerator_backend(group):
        return device_of(group)
    held = next((t.device for t in [*model.parameters(), *model.buffers()] if not t.is_meta), None)
    if held is not None and held.type in served(group):
        return held
    try:
        return device_of(group)
    except DeviceError as exc:
        where = f"the model is on {held.type}, and " if held is not None else ""
        raise DeviceError(f"{where}{exc}; or pass device= (one rank only)") from None


def host_group(group):
    """A group over ``group``'s ranks that carries CPU tensors (messages of the host: a serving engine's steps):
    ``group`` itself where it serves the CPU, else a new gloo group beside it, made by its ranks alone, with the
    group's timeout and rank order (a collective: its caller makes it once)."""
    if "cpu" in served(group):
        return group
    timeout = group._get_backend(next(iter(group._device_types))).options._timeout
    return dist.new_group(
        dist.get_process_group_ranks(group),
        timeout=timeout,
        backend="gloo",
        use_local_synchronization=True,
        sort_ranks=False,
    )
