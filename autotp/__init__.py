"""autotp: automatic tensor parallelism for PyTorch models, derived from the graph.

The public names load on first use (PEP 562), so ``autotp --help`` and a usage error import neither torch nor
transformers."""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

# each public name -> the module that defines it
_WHERE = {
    "CheckpointError": "autotp.runtime.hf_checkpoint",
    "Plan": "autotp.plan",
    "PlanMismatch": "autotp.plan",
    "PlanningError": "autotp.planning.solution",
    "checkpoint_state_dict": "autotp.runtime.dcp_checkpoint",
    "free_generation_cache": "autotp.serving.generation",
    "from_pretrained": "autotp.api",
    "full_state_dict": "autotp.runtime.hf_checkpoint",
    "generate": "autotp.serving.generation",
    "load_checkpoint_state_dict": "autotp.runtime.dcp_checkpoint",
    "materialize": "autotp.runtime.materialize",
    "parallel_cross_entropy": "autotp.runtime.losses",
    "parallelize": "autotp.parallel.mesh",
    "plan": "autotp.api",
    "plan_mesh": "autotp.planning.mesh_search",
    "save_pretrained": "autotp.runtime.hf_checkpoint",
}
__all__ = sorted(_WHERE)
__version__ = "0.1.0"

if TYPE_CHECKING:
    from autotp.api import from_pretrained as from_pretrained
    from autotp.api import plan as plan
    from autotp.parallel.mesh import parallelize as parallelize
    from autotp.plan import Plan as Plan
    from autotp.plan import PlanMismatch as PlanMismatch
    from autotp.planning.mesh_search import plan_mesh as plan_mesh
    from autotp.planning.solution import PlanningError as PlanningError
    from autotp.runtime.dcp_checkpoint import (
        checkpoint_state_dict as checkpoint_state_dict,
    )
    from autotp.runtime.dcp_checkpoint import (
        load_checkpoint_state_dict as load_checkpoint_state_dict,
    )
    from autotp.runtime.hf_checkpoint import (
        CheckpointError as CheckpointError,
    )
    from autotp.runtime.hf_checkpoint import (
        full_state_dict as full_state_dict,
    )
    from autotp.runtime.hf_checkpoint import (
        save_pretrained as save_pretrained,
    )
    from autotp.runtime.losses import parallel_cross_entropy as parallel_cross_entropy
    from autotp.runtime.materialize import materialize as materialize
    from autotp.serving.generation import free_generation_cache as free_generation_cache
    from autotp.serving.generation import generate as generate


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'autotp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # once loaded, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


class _Package(types.ModuleType):
    """The package, whose ``plan`` stays the function: importing the submodule autotp/plan.py would otherwise
    set ``autotp.plan`` to that module (as the eager imports once settled by importing api first)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "plan" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
