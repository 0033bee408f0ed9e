"""How to plan: the options of ``autotp.plan`` and ``autotp.parallelize`` that reach the solver, in one value."""
from __future__ import annotations

from dataclasses import dataclass

from .runtime.dropout import MODES


@dataclass(frozen=True)
class Options:
    """``topology``: a profile name, a path or a loaded profile (None: the default).  ``min_shard_fraction``:
    parameters at least this large (against the largest) are only offered sharded.  ``memory_limit``: bytes
    per device (None: 90% of the topology's).  ``gather_outputs=False`` leaves sharded outputs on their ranks.
    ``fixed``: parameter name -> placement to impose.  ``sequence_parallel``: True forces it, False rules it
    out, None offers it only when no plan without it fits.  ``recompute``: "selective" recomputes every
    attention core, False none, None offers it (priced per core) only when no plan fits without it.
    ``experts``: "tensor" or "parallel" imposes that split of mixture-of-experts layers, None lets the cost
    model choose."""
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

    def __post_init__(self):
        if self.sequence_parallel not in (None, True, False):
            raise ValueError(f"sequence_parallel must be None, True or False, got {self.sequence_parallel!r}")
        if self.recompute not in (None, "selective", False):
            raise ValueError(f'recompute must be None, "selective" or False, got {self.recompute!r}')
        if self.experts not in (None, "tensor", "parallel"):
            raise ValueError(f'experts must be None, "tensor" or "parallel", got {self.experts!r}')
        if self.dropout not in MODES:
            raise ValueError(f'dropout must be "default" or "reference" (for tests), got {self.dropout!r}')
