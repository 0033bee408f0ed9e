"""How to plan: the options of ``autotp.plan`` and ``autotp.parallelize`` that reach the solver, in one value."""
from __future__ import annotations

from dataclasses import dataclass

from autotp.cost_models.pricing import IMBALANCE
from autotp.runtime.dropout import MODES

EXPERTS = (None, "tensor", "parallel", "all-to-all")


@dataclass(frozen=True)
class Options:
    """``topology``: a profile name, a path or a loaded profile (None: the default).  ``min_shard_fraction``:
    parameters at least this large (against the largest) are only offered sharded.  ``memory_limit``: bytes
    per device (None: 90% of the topology's).  ``gather_outputs=False`` leaves sharded outputs on their ranks.
    ``fixed``: parameter name -> placement to impose.  ``sequence_parallel``: True forces it, False rules it
    out, None offers it only when no plan without it fits.  ``recompute``: "selective" recomputes every
    attention core, False none, None offers it (priced per core) only when no plan fits without it.
    ``experts``: "tensor" (every expert split), "parallel" (whole experts, computed where they are stored, zeros
    for other experts' rows) or "all-to-all" (whole experts, rows dispatched to their owners) imposes that
    split of mixture-of-experts layers, None lets the cost model choose.  ``ep``: ranks of a mesh's "ep"
    dimension over which every expert segment is dispatched as well (parallel/mesh.py).
    ``expert_imbalance``: the busiest rank's routed rows over the uniform top-k share (pricing.IMBALANCE)."""
    topology: object = None
    min_shard_fraction: float = 0.02
    training: bool = True
    memory_limit: float | None = None
    gather_outputs: bool = True
    fixed: dict | None = None
    sequence_parallel: bool | None = None
    recompute: str | bool | None = None
    experts: str | None = None
    dropout: str = "default"
    ep: int = 1
    expert_imbalance: float = IMBALANCE

    def __post_init__(self):
        if self.sequence_parallel not in (None, True, False):
            raise ValueError(f"sequence_parallel must be None, True or False, got {self.sequence_parallel!r}")
        if self.recompute not in (None, "selective", False):
            raise ValueError(f'recompute must be None, "selective" or False, got {self.recompute!r}')
        if self.experts not in EXPERTS:
            raise ValueError(f'experts must be None, "tensor", "parallel" or "all-to-all", got {self.experts!r}')
        if not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"ep must be a positive number of ranks, got {self.ep!r}")
        if self.ep > 1 and self.experts == "parallel":
            raise ValueError('experts="parallel" computes whole experts on the TP group alone; with a mesh\'s "ep" '
                             'dimension choose "all-to-all" or "tensor" (or None)')
        if not self.expert_imbalance >= 1:
            raise ValueError(f"expert_imbalance is the busiest rank's load over the uniform share, at least 1: got "
                             f"{self.expert_imbalance!r}")
        if self.dropout not in MODES:
            raise ValueError(f'dropout must be "default" or "reference" (for tests), got {self.dropout!r}')
