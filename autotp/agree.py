"""Rank agreement with a deadline: every rank must present the same model and inputs, and a rank
that fails or dies makes the others raise within ``timeout`` seconds instead of hanging.

Messages go through the process group's key-value store, whose waits take a timeout of their own.
"""
from __future__ import annotations

import datetime
import hashlib
import itertools

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

DEFAULT_TIMEOUT = 120.0
_calls = itertools.count()


class RankDisagreement(RuntimeError):
    pass


def inputs_digest(args, kwargs) -> str:
    """Shapes and dtypes of the example inputs (their values may differ between ranks)."""
    leaves = tree_leaves((args, kwargs or {}))
    text = ";".join(f"{tuple(x.shape)}:{x.dtype}" if isinstance(x, torch.Tensor) else repr(type(x))
                    for x in leaves)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Rendezvous:
    """One parallelize call's exchanges; ranks must make their calls in the same order."""

    def __init__(self, group, timeout: float = DEFAULT_TIMEOUT):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.timeout = timeout
        self.prefix = f"autotp/{group.group_name}/{next(_calls)}"
        self.store = dist.distributed_c10d._get_default_store()

    def _wait(self, keys: list[str], what: str) -> None:
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout))
        except Exception as exc:  # the store raises its own timeout and connection errors
            try:
                missing = [k.rsplit("/", 1)[-1] for k in keys if not self.store.check([k])]
            except Exception:  # the store lives in rank 0's process: it is gone
                missing = ["0 (it hosts the rendezvous store)"]
            raise RankDisagreement(
                f"rank(s) {', '.join(missing)} did not {what} within {self.timeout:.0f} s: they failed or died "
                "(see their own errors); pass timeout= to autotp.parallelize to wait longer") from exc

    def _acknowledge(self, name: str) -> None:
        """Rank 0 hosts the store: it waits until every rank has read before it may go on (and exit)."""
        self.store.set(f"{self.prefix}/{name}/read/{self.rank}", "1")
        if self.rank == 0:
            self._wait([f"{self.prefix}/{name}/read/{r}" for r in range(self.world)], f"read the {name}")

    def agree(self, name: str, value: str, what: str) -> None:
        """Every rank publishes ``value``; all must be equal."""
        self.store.set(f"{self.prefix}/{name}/{self.rank}", value)
        keys = [f"{self.prefix}/{name}/{r}" for r in range(self.world)]
        self._wait(keys, f"reach {what}")
        values = {r: self.store.get(k).decode() for r, k in enumerate(keys)}
        self._acknowledge(name)
        if len(set(values.values())) > 1:
            groups: dict = {}
            for r, v in values.items():
                groups.setdefault(v, []).append(r)
            listed = "; ".join(f"ranks {rs}: {v}" for v, rs in groups.items())
            raise RankDisagreement(f"ranks disagree on {what} ({listed}): every rank must build the same model "
                                   "and pass example inputs of the same shapes and dtypes")

    def share(self, name: str, make) -> str:
        """Rank 0 computes ``make()`` (or its error) and every rank receives it."""
        key = f"{self.prefix}/{name}"
        if self.rank == 0:
            try:
                self.store.set(key, "ok:" + make())
            except Exception as exc:
                self.store.set(key, f"error:{type(exc).__name__}: {exc}")
                raise
        self._wait([key], f"receive the {name} from rank 0 (rank 0 must finish it)")
        body = self.store.get(key).decode()
        self._acknowledge(name)
        if body.startswith("error:"):
            raise RankDisagreement(f"{name} failed on rank 0: {body[6:]}")
        return body[3:]
