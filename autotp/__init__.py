"""autotp: automatic tensor parallelism for PyTorch models, derived from the graph."""
from .api import from_pretrained, plan
from .generation import free_generation_cache, generate
from .mesh_planner import plan_mesh
from .parallel.dcp import checkpoint_state_dict, load_checkpoint_state_dict
from .parallel.mesh import parallelize
from .plan import Plan, PlanMismatch
from .runtime.hf_checkpoint import CheckpointError, full_state_dict, save_pretrained
from .runtime.losses import parallel_cross_entropy
from .runtime.materialize import materialize

__all__ = ["CheckpointError", "Plan", "PlanMismatch", "checkpoint_state_dict", "free_generation_cache",
           "from_pretrained", "full_state_dict", "generate", "load_checkpoint_state_dict", "materialize",
           "parallel_cross_entropy", "parallelize", "plan", "plan_mesh", "save_pretrained"]
__version__ = "0.1.0"
