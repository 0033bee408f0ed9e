"""autotp: automatic tensor parallelism for PyTorch models, derived from the graph."""
from .api import from_pretrained, parallelize, plan
from .generation import free_generation_cache, generate
from .mesh import choose_mesh
from .plan import Plan, PlanMismatch
from .runtime.checkpoint import CheckpointError, full_state_dict, save_pretrained
from .runtime.losses import parallel_cross_entropy

__all__ = ["CheckpointError", "Plan", "PlanMismatch", "choose_mesh", "free_generation_cache", "from_pretrained",
           "full_state_dict", "generate", "parallel_cross_entropy", "parallelize", "plan", "save_pretrained"]
__version__ = "0.1.0"
