"""autotp: automatic tensor parallelism for PyTorch models, derived from the graph."""
from .api import full_state_dict, parallelize, plan
from .mesh import choose_mesh
from .plan import Plan, PlanMismatch

__all__ = ["Plan", "PlanMismatch", "choose_mesh", "full_state_dict", "parallelize", "plan"]
__version__ = "0.1.0"
