"""autotp: automatic tensor parallelism for PyTorch models, derived from the graph."""
from .api import full_state_dict, parallelize, plan
from .plan import Plan, PlanMismatch

__all__ = ["Plan", "PlanMismatch", "full_state_dict", "parallelize", "plan"]
__version__ = "0.1.0"
