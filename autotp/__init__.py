"""autotp: automatic tensor parallelism for PyTorch models, derived from the graph."""
from .api import from_pretrained, parallelize, plan
from .generation import generate
from .mesh import plan_mesh
from .plan import Plan, PlanMismatch
from .runtime.checkpoint import CheckpointError, full_state_dict, save_pretrained
from .runtime.losses import parallel_cross_entropy

__all__ = ["CheckpointError", "Plan", "PlanMismatch", "from_pretrained", "full_state_dict",
           "generate", "parallel_cross_entropy", "parallelize", "plan", "plan_mesh", "save_pretrained"]
__version__ = "0.1.0"
