"""Pure cost functions: seconds for collectives, resharding and compute (installed as autotp.cost_models)."""

from autotp.cost_models.communication import collective_time, reshard_time
from autotp.cost_models.topology import Topology, load_topology

__all__ = ["Topology", "collective_time", "load_topology", "reshard_time"]
