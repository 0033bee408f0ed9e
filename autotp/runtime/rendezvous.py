"""Rank agreement with a deadline: every rank must present the same model and inputs, and a rank
that fails or dies makes the others raise instead of hanging.

Messages go through the process group's key-value store, under a prefix per ``parallelize`` call
(each rank counts its calls per group), and rank 0 deletes an exchange's keys once every rank has
read them.  The store cannot tell a dead rank from a slow one; on gloo, each exchange also sends
every peer one point-to-point message (see ``_Presence``), which fails as soon as the peer's
connection closes, so a dead rank is named within seconds while a slow one gets the whole ``timeout``.
"""

from __future__ import annotations

import datetime
import hashlib
import threading
import time

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from autotp.runtime.devices import served

DEFAULT_TIMEOUT = 120.0
PROBE_TAG = 0x617470  # the presence messages' point-to-point tag ("atp")
_calls: dict = {}  # group name -> parallelize calls this process has made on it


class RankDisagreement(RuntimeError):
    pass


def inputs_digest(args, kwargs) -> str:
    """Shapes and dtypes of the example inputs (their values may differ between ranks)."""
    leaves = tree_leaves((args, kwargs or {}))
    text = ";".join(f"{tuple(x.shape)}:{x.dtype}" if isinstance(x, torch.Tensor) else repr(type(x)) for x in leaves)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def values_digest(args, kwargs) -> str:
    """The inputs' values: every tensor's bytes, and plain Python values (other objects by type)."""
    digest = hashlib.sha256()
    for x in tree_leaves((args, kwargs or {})):
        if isinstance(x, torch.Tensor):
            data = x.detach().cpu().contiguous()
            digest.update(f"{tuple(data.shape)}:{data.dtype}:".encode())
            digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif x is None or isinstance(x, (bool, int, float, str)):
            digest.update(repr(x).encode())
        else:
            digest.update(repr(type(x)).encode())
    return digest.hexdigest()[:16]


class _Presence:
    """One exchange's liveness probe: this rank sends every peer one message and receives one from each.
    A receive completes once the peer has reached the exchange, and fails at once when the peer's
    connection closes (it crashed or exited): gloo notices a closed socket immediately."""

    def __init__(self, group, rank: int, world: int, timeout: float):
        self.lost: dict[int, str] = {}
        self.threads = []
        for peer in range(world):
            if peer == rank:
                continue
            try:  # posted here, in order; waited for on a thread (a timed-out gloo wait closes the connection)
                works = [group.send([torch.zeros(1)], peer, PROBE_TAG), group.recv([torch.zeros(1)], peer, PROBE_TAG)]
            except RuntimeError as exc:
                self.lost[peer] = str(exc)
                continue
            thread = threading.Thread(target=self._watch, args=(peer, works, timeout), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _watch(self, peer: int, works: list, timeout: float) -> None:
        try:
            for work in works:
                work.wait(datetime.timedelta(seconds=timeout))
        except RuntimeError as exc:
            if "imed out" not in str(exc):  # a timeout means slow, which the store's deadline handles
                self.lost[peer] = str(exc)

    def join(self, deadline: float) -> None:
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def _store_gone() -> RankDisagreement:
    return RankDisagreement(
        "rank 0 is gone (it hosts the rendezvous store, and its connection closed): it failed "
        "or died; see its own errors"
    )


class Rendezvous:
    """One parallelize call's exchanges; ranks must make their calls in the same order."""

    def __init__(self, group, timeout: float = DEFAULT_TIMEOUT):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.timeout = timeout
        if dist.get_backend(group) == "fake":  # a dry run: one process stands for every rank (no store, no peers),
            self.world, self.probe = 1, False  # so it agrees with itself; plans are still solved for the group's size
            return
        self.store = dist.distributed_c10d._get_default_store()
        self.call = _calls[group.group_name] = _calls.get(group.group_name, 0) + 1
        self.probe = "cpu" in served(group)  # the probe's messages are CPU tensors: NCCL alone carries none
        self.root = f"autotp/{group.group_name}"
        self.prefix = f"{self.root}/{self.call}"
        try:
            self.store.set(f"{self.root}/calls/{self.rank}", str(self.call))
        except Exception as exc:
            raise _store_gone() from exc

    def _presence(self) -> _Presence | None:
        return _Presence(self.group, self.rank, self.world, self.timeout) if self.probe else None

    def _wait(self, keys: list[str], ranks: list[int], what: str, presence: _Presence | None = None) -> None:
        """Until every key exists; ``ranks[i]`` writes ``keys[i]``."""
        deadline = time.monotonic() + self.timeout
        pause = 0.001
        while not self._check(keys):
            if presence is not None and presence.lost:
                raise self._lost(presence, what)
            if time.monotonic() > deadline:
                raise RankDisagreement(self._late(keys, ranks, what, presence))
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        if presence is not None:
            presence.join(deadline)
            if presence.lost:
                raise self._lost(presence, what)

    def _check(self, keys: list[str]) -> bool:
        try:
            return self.store.check(keys)
        except Exception as exc:
            raise _store_gone() from exc

    def _lost(self, presence: _Presence, what: str) -> RankDisagreement:
        ranks = sorted(presence.lost)
        cause = presence.lost[ranks[0]].split(". This is")[0]
        who = f"rank {ranks[0]} is" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} are"
        return RankDisagreement(
            f"{who} gone while this rank waited for every rank to {what}: its connection closed, "
            f"so it crashed or exited (see its own errors). gloo: {cause}"
        )

    def _late(self, keys: list[str], ranks: list[int], what: str, presence: _Presence | None) -> str:
        """Why ranks missed the deadline, as far as this rank can tell."""
        reasons = []
        for key, rank in zip(keys, ranks, strict=True):
            if self._check([key]):
                continue
            calls_key = f"{self.root}/calls/{rank}"
            calls = int(self.store.get(calls_key)) if self._check([calls_key]) else 0
            if calls != self.call:
                reasons.append(
                    f"rank {rank} has made {calls} parallelize call(s) on this group and this rank "
                    f"{self.call}: every rank must call autotp.parallelize equally often, in the same "
                    "order (or it is slow to reach this call)"
                )
            elif presence is not None:
                reasons.append(
                    f"rank {rank} is alive (its connection is open) but did not {what}: it is slow, "
                    "stuck, or failed and went on (see its own errors)"
                )
            else:
                reasons.append(f"rank {rank} did not {what}: it failed, died, or is slow (see its own errors)")
        return f"{'; '.join(reasons)} (waited {self.timeout:.0f} s; pass timeout= to autotp.parallelize to wait longer)"

    def _acknowledge(self, name: str, keys: list[str]) -> None:
        """Rank 0 hosts the store: it waits until every rank has read, then deletes the exchange's keys
        (and may go on, or exit)."""
        self.store.set(f"{self.prefix}/{name}/read/{self.rank}", "1")
        if self.rank == 0:
            read = [f"{self.prefix}/{name}/read/{r}" for r in range(self.world)]
            self._wait(read, list(range(self.world)), f"read the {name}")
            for key in keys + read:
                self.store.delete_key(key)

    def agree(
        self,
        name: str,
        value: str,
        what: str,
        fix: str = "every rank must build the same model and pass example inputs of the same shapes and dtypes",
    ) -> None:
        """Every rank publishes ``value``; all must be equal."""
        if self.world == 1:
            return  # nothing to agree on, and no store to lean on (its host may have exited)
        presence = self._presence()
        self.store.set(f"{self.prefix}/{name}/{self.rank}", value)
        keys = [f"{self.prefix}/{name}/{r}" for r in range(self.world)]
        self._wait(keys, list(range(self.world)), f"reach {what}", presence)
        values = {r: self.store.get(k).decode() for r, k in enumerate(keys)}
        self._acknowledge(name, keys)
        if len(set(values.values())) > 1:
            groups: dict = {}
            for r, v in values.items():
                groups.setdefault(v, []).append(r)
            listed = "; ".join(f"ranks {rs}: {v}" for v, rs in groups.items())
            raise RankDisagreement(f"ranks disagree on {what} ({listed}): {fix}")

    def share(self, name: str, make) -> str:
        """Rank 0 computes ``make()`` (or its error) and every rank receives it."""
        if self.world == 1:
            return make()
        presence = self._presence()
        key = f"{self.prefix}/{name}"
        if self.rank == 0:
            try:
                self.store.set(key, "ok:" + make())
            except Exception as exc:
                self.store.set(key, f"error:{type(exc).__name__}: {exc}")
                raise
        self._wait([key], [0], f"share the {name} (rank 0 makes it for every rank)", presence)
        body = self.store.get(key).decode()
        self._acknowledge(name, [key])
        if body.startswith("error:"):
            raise RankDisagreement(f"{name} failed on rank 0: {body[6:]}")
        return body[3:]


class InputCheck:
    """A forward pre-hook: tensor-parallel ranks must get the same inputs (different ones give silently
    wrong results), so ranks compare a digest of the input values, on the first call or on every call."""

    def __init__(self, rendezvous: Rendezvous, every_call: bool):
        self.rendezvous, self.every_call = rendezvous, every_call
        self.calls = 0
        self.handle = None

    def attach(self, module: torch.nn.Module) -> None:
        self.handle = module.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs) -> None:
        if not torch.compiler.is_compiling():  # traced inside a caller's graph (checkpoint of the program): skipped
            self._agree(args, kwargs)

    @torch.compiler.disable  # store traffic and hashing run eagerly, before the compiled program
    def _agree(self, args, kwargs) -> None:
        self.calls += 1
        if not self.every_call:
            self.handle.remove()
        what = f"the input values of call {self.calls}"
        self.rendezvous.agree(
            f"inputs/{self.calls}",
            values_digest(args, kwargs),
            what,
            "every rank must pass the same inputs to the sharded model (same batch; the same seed "
            "for random inputs); check_inputs=False turns this check off",
        )


def random_digest(device: torch.device) -> str:
    """The default generators' states, CPU and ``device``'s: what every dropout draws from."""
    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    if device.type != "cpu":
        digest.update(torch.get_device_module(device.type).get_rng_state(device).numpy().tobytes())
    return digest.hexdigest()[:16]


class RandomCheck:
    """A forward pre-hook on a program that drops: ranks of a group draw replicated masks from their default
    generators, which must be in the same state (or each rank drops differently, silently), so on the first call
    that drops (or every one) the ranks compare them."""

    def __init__(self, rendezvous: Rendezvous, every_call: bool, dropouts: list, device: torch.device):
        self.rendezvous, self.every_call, self.dropouts, self.device = rendezvous, every_call, dropouts, device
        self.calls = 0
        self.handle = None

    def attach(self, module: torch.nn.Module) -> None:
        self.handle = module.register_forward_pre_hook(self)

    def __call__(self, module, args) -> None:
        if not torch.compiler.is_compiling():  # as InputCheck
            self._agree()

    @torch.compiler.disable
    def _agree(self) -> None:
        if not any(m.training for m in self.dropouts):
            return
        self.calls += 1
        if not self.every_call:
            self.handle.remove()
        self.rendezvous.agree(
            f"random/{self.calls}",
            random_digest(self.device),
            f"the random generators' states at call {self.calls} that drops",
            "every rank of a tensor-parallel group must seed alike (torch.manual_seed(seed) with "
            "one seed) and draw the same random numbers outside the model; check_inputs=False "
            "turns this check off",
        )
