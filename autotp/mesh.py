"""Mesh choice: which TP size (the rest data-parallel) is fastest on a topology, and does it fit."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from autotp.cost_models import collective_time, load_topology
from autotp.cost_models.memory import state_factor
from autotp.cost_models.topology import Topology
from autotp.passes.solve import PlanningError, Sizes

from .api import _graph, _solve


@dataclass
class Candidate:
    tp: int
    dp: int
    seconds: float | None        # estimated step time; None when it does not fit
    memory: float | None         # estimated bytes per device
    note: str = ""


def _dp_topology(topo: Topology, tp: int) -> Topology:
    """The fabric a data-parallel group sees: its members sit ``tp`` ranks apart."""
    per_node = max(1, topo.gpus_per_node // tp)
    nics = max(1, topo.nics_per_node * per_node // topo.gpus_per_node) if topo.nics_per_node else 0
    return dataclasses.replace(topo, gpus_per_node=per_node, nodes=topo.devices // tp // per_node, nics_per_node=nics)


def _batch_symbol(gm: torch.fx.GraphModule) -> tuple[str, int] | None:
    """The first input's leading dim, if dynamic: the batch that data parallelism divides."""
    for node in gm.graph.nodes:
        v = node.meta.get("val")
        if node.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() and not isinstance(v.shape[0], int):
            expr = v.shape[0].node.expr
            return str(expr), Sizes()(v.shape[0])
    return None


def _weights(gm: torch.fx.GraphModule) -> list:
    """(parameter, how many real copies it stands for: a folded block's weights count for every block)."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    folding = gm.meta.get("autotp_fold")
    found = {id(params[n.target]): (params[n.target], folding.weights[n] if folding else 1)
             for n in gm.graph.nodes if n.op == "get_attr" and n.target in params}
    return list(found.values())


def choose_mesh(model: torch.nn.Module, args=None, kwargs=None, *, devices: int | None = None, topology=None,
                training: bool = True, memory_limit: float | None = None) -> list[Candidate]:
    """Every TP size that divides ``devices`` (TP groups on consecutive ranks, filling nodes first),
    priced with the example inputs as the global batch; best (fitting, fastest) first."""
    return choose_mesh_for_graph(_graph(model, args, kwargs, fold=True), devices=devices, topology=topology,
                                 training=training, memory_limit=memory_limit)


def choose_mesh_for_graph(gm: torch.fx.GraphModule, *, devices: int | None = None, topology=None,
                          training: bool = True, memory_limit: float | None = None) -> list[Candidate]:
    """choose_mesh on an already captured graph (capture once, price many meshes)."""
    topo = load_topology(topology)
    devices = devices or topo.devices
    batch = _batch_symbol(gm)
    limit = memory_limit if memory_limit is not None else 0.9 * topo.memory_bytes
    floor = sum(p.numel() * p.element_size() * state_factor(p.element_size(), training) * count
                for p, count in _weights(gm))
    found = []
    for tp in (n for n in range(1, devices + 1) if devices % n == 0):
        dp = devices // tp
        if floor / tp > limit:
            found.append(Candidate(tp, dp, None, floor / tp, "parameters alone exceed the memory limit"))
            continue
        if batch and batch[1] % dp:
            found.append(Candidate(tp, dp, None, None, f"batch {batch[1]} does not divide by {dp} replicas"))
            continue
        sizes = Sizes({batch[0]: batch[1] // dp} if batch else {})
        try:
            plan = _solve(gm, tp, topo, training=training, memory_limit=limit, sizes=sizes)
        except PlanningError as exc:
            found.append(Candidate(tp, dp, None, None, str(exc)))
            continue
        memory = plan.cost["memory"]
        seconds = plan.cost["seconds"]
        if training and dp > 1:  # gradients of this rank's parameter shard, averaged over replicas
            seconds += collective_time("all_reduce", memory["params"], dp, _dp_topology(topo, tp))
        found.append(Candidate(tp, dp, seconds, memory["total"]))
    return sorted(found, key=lambda c: (c.seconds is None, c.seconds or 0.0, c.tp))
