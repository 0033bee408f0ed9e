"""Weights read by two pipeline stages (tied input and output embeddings): Megatron's embedding group.

The stage reading the embedding (the first) and the one reading the output head (the last) each hold a copy of
the tied weight.  Both copies start equal (the same stored or seeded tensor, or the same model's values) and take
the same TP split, chosen from what every reader of the weight takes in the whole model's graph, so the pieces of
the two copies line up rank by rank (and again under FSDP2's split); after each step's backward the copies'
gradients are summed over the pipeline ranks that hold them at the same (dp, tp) place, before the optimizer step,
so the copies stay equal as one weight would.  Which stages hold a copy is read from a stage's own capture: every
capture has the model's parts before and after the blocks (split.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autotp.placement import R, Shard


class Tied:
    """The model's tied weights, the stages holding each, and this rank's group to sum their gradients over."""

    def __init__(self, model: torch.nn.Module, count: int):
        by_id: dict = {}
        for name, tensor in model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(tensor), []).append(name)
        self.sets = [names for names in by_id.values() if len(names) > 1]  # the model's first name leads
        self.count = count
        self.holders: dict = {}  # tied set index -> stage indices holding a copy
        self.groups: dict = {}  # tied set index -> this rank's group over the pipeline ranks holding it (or None)

    def read(self, stage) -> None:
        """Note which stages hold each tied weight, from ``stage``'s capture (split.Stage.outside)."""
        for k, names in enumerate(self.sets):
            parts = set().union(*(stage.outside.get(name, set()) for name in names))
            self.holders[k] = sorted({0 for p in parts if p == "pre"} | {self.count - 1 for p in parts if p == "post"})

    def names(self, graph: torch.nn.Module) -> list:
        """The names in ``graph`` of weights held by more than one stage."""
        held = {name for name, _ in graph.named_parameters(remove_duplicate=False)}
        return [
            name
            for k, names in enumerate(self.sets)
            if len(self.holders.get(k, ())) > 1
            for name in names
            if name in held
        ]

    def placements(self, graph: torch.nn.Module, offered) -> dict:
        """The TP placement each copy in ``graph`` takes, the same on every holder: of those ``offered()`` gives
        the weight in the whole model's graph (where every reader is), a split of dim 0 (the vocabulary, as
        Megatron splits tied embeddings), else another split, else replicated."""
        here = self.names(graph)
        if not here:
            return {}
        options = offered()
        fixed = {}
        for names in self.sets:
            each = [set(options[name]) for name in names if name in options]  # every name its readers read it by
            shards = sorted(
                (p for p in set.intersection(*each) if isinstance(p, Shard)) if each else (),
                key=lambda p: (p.dim != 0, str(p)),
            )
            fixed.update(dict.fromkeys((n for n in names if n in here), shards[0] if shards else R))
        return fixed

    def canonical(self, name: str) -> str:
        """The model's first name for a tied weight (the name it is saved under); other names unchanged."""
        return next((names[0] for names in self.sets if name in names), name)

    def connect(self, mesh, rank_of) -> None:
        """Groups over the pipeline ranks (``rank_of(stage index)``) holding each tied weight, at this rank's
        place in the other mesh dimensions; made only by their members."""
        coordinate = mesh.get_coordinate()
        pp = mesh.mesh_dim_names.index("pp")
        for k, stages in self.holders.items():
            ranks = sorted({rank_of(index) for index in stages})
            if len(stages) < 2 or coordinate[pp] not in ranks:
                continue
            if len(ranks) == 1:  # both copies on this rank: summed here
                self.groups[k] = None
                continue
            members = []
            for r in ranks:
                at = list(coordinate)
                at[pp] = r
                members.append(int(mesh.mesh[tuple(at)]))
            self.groups[k] = dist.new_group(members, use_local_synchronization=True)

    def sum_gradients(self, modules) -> None:
        """Each tied weight's gradient, summed over every copy (this rank's and its group's), in every copy."""
        for k, group in self.groups.items():
            copies = {}
            for module in modules:
                for name, param in module.named_parameters(remove_duplicate=False):
                    if name in self.sets[k] and param.grad is not None:
                        copies[id(param)] = param
            grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in copies.values()]
            if not grads:
                continue
            total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
            if group is not None:
                dist.all_reduce(total, group=group)
            for grad in grads:
                if grad is not total:
                    grad.copy_(total)
