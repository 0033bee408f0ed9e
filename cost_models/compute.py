"""Time of one op on one device: the slower of its arithmetic and its memory traffic (roofline)."""
from __future__ import annotations

from .topology import Topology


def op_time(flops: float, nbytes: float, topology: Topology) -> float:
    return max(flops / (topology.peak_flops * topology.matmul_efficiency),
               nbytes / (topology.hbm_bandwidth * topology.memory_efficiency))
