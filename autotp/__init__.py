"""autotp: automatic tensor parallelism for PyTorch models, derived from the graph."""

from autotp.api import from_pretrained, plan
from autotp.parallel.mesh import parallelize
from autotp.plan import Plan, PlanMismatch
from autotp.planning.mesh_search import plan_mesh
from autotp.planning.solution import PlanningError
from autotp.runtime.dcp_checkpoint import checkpoint_state_dict, load_checkpoint_state_dict
from autotp.runtime.hf_checkpoint import CheckpointError, full_state_dict, save_pretrained
from autotp.runtime.losses import parallel_cross_entropy
from autotp.runtime.materialize import materialize
from autotp.serving.generation import free_generation_cache, generate

__all__ = [
    "CheckpointError",
    "Plan",
    "PlanMismatch",
    "PlanningError",
    "checkpoint_state_dict",
    "free_generation_cache",
    "from_pretrained",
    "full_state_dict",
    "generate",
    "load_checkpoint_state_dict",
    "materialize",
    "parallel_cross_entropy",
    "parallelize",
    "plan",
    "plan_mesh",
    "save_pretrained",
]
__version__ = "0.1.0"
