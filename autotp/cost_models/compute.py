"""Time of one op on one device: the slower of its arithmetic and its memory traffic (roofline)."""
from __future__ import annotations

from pathlib import Path

from .topology import Topology, load_topology


def op_time(flops: float, nbytes: float, topology: Topology | str | Path | None) -> float:
    """Seconds on one device; ``topology``: a profile name, a path or a loaded profile (None: the default)."""
    topology = load_topology(topology)
    return max(flops / (topology.peak_flops * topology.matmul_efficiency),
               nbytes / (topology.hbm_bandwidth * topology.memory_efficiency))
