"""autotp: automatic tensor parallelism for PyTorch models, derived from the graph."""
from .api import from_pretrained, full_state_dict, parallelize, plan
from .checkpoint import CheckpointError, save_pretrained
from .generation import generate
from .losses import parallel_cross_entropy
from .mesh import choose_mesh
from .plan import Plan, PlanMismatch

__all__ = ["CheckpointError", "Plan", "PlanMismatch", "choose_mesh", "from_pretrained", "full_state_dict",
           "generate", "parallel_cross_entropy", "parallelize", "plan", "save_pretrained"]
__version__ = "0.1.0"
