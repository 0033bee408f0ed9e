"""The options of autotp's public calls as typed values, built once at the boundary and passed whole.

``parallelize(model, args, **options)`` sorts its keywords into what to plan (PlanOptions), how to run the plan
(RunOptions) and how a mesh composes it (MeshOptions) with ``from_keywords``; a misspelt option fails there, in
one line that lists the valid ones.  Each value checks its own fields when it is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from autotp.cost_models.pricing import IMBALANCE
from autotp.placement import parse
from autotp.runtime.dropout import MODES
from autotp.runtime.rendezvous import DEFAULT_TIMEOUT

if TYPE_CHECKING:
    from autotp.cost_models.topology import Topology

EXPERTS = (None, "tensor", "parallel", "all-to-all")
INPUT_CHECKS = ("first", "always", False)


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """What to plan: the cluster, the memory, the work, and the placements a caller imposes."""

    topology: str | Path | Topology | None = None
    """A topology profile's name, a JSON file's path or a loaded Topology; None: the default profile."""
    memory_limit: float | None = None
    """Bytes per device a plan may use; None: ``cost_models.memory.memory_limit`` (90% of the device's)."""
    training: bool = True
    """Price gradients, optimizer state and the backward; False: inference (forward only)."""
    sequence_parallel: bool | None = None
    """Split norms, dropouts and residual adds by tokens: True forces it, False rules it out, None solves with and
    without it and keeps the cheaper plan that fits."""
    recompute: str | bool | None = None
    """"selective" recomputes every attention core in the backward, False none, None offers it (priced per core)
    only when no plan fits without it."""
    experts: str | None = None
    """Mixture-of-experts layers: "tensor" (each expert split), "parallel" (whole experts, computed where they are
    stored), "all-to-all" (whole experts, rows dispatched to their owners), None: the cost model chooses."""
    ep: int = 1
    """Ranks of a mesh's "ep" dimension over which every expert segment is dispatched as well."""
    expert_imbalance: float = IMBALANCE
    """The busiest rank's routed rows over the uniform top-k share, for pricing dispatch."""
    fixed: Mapping[str, Any] | None = None
    """Parameter name -> placement to impose (another program's layout, to share its shards): a Placement or its
    text (``"S(0)"``, ``"R"``, as plans write them); a tied weight's placement holds under each of its names.  A
    module's name -> ``"R"``: every op inside it computed whole on every rank, its parameters held whole."""
    min_shard_fraction: float = 0.02
    """Parameters at least this large (against the largest) are only offered sharded."""
    parameter_sizes: Mapping[str, int] | None = None
    """Parameter name -> its number of elements in the model the plan stands for (a shrunk config standing for the
    full one): what ``min_shard_fraction`` compares, where a small config's proportions differ from the full one's
    (a position-bias MLP as wide as a projection).  Names it leaves out are compared at their own sizes."""
    gather_outputs: bool = True
    """Return full outputs on every rank; False leaves outputs sharded where the plan computes them sharded."""
    async_tp: bool | None = False
    """Asynchronous TP under torch.compile: True turns on inductor's micro-pipeline TP pass (all-gathers and
    reduce-scatters fused with their matmuls, each split into per-rank chunks that overlap) and, on CUDA, symmetric
    memory for the group, which the fused ops need; the plan is priced with those pairs fused
    (``cost_models.communication.fused_time``), so sequence parallelism may win where it did not.  None: the
    planner prices the plan with and without and keeps the cheaper, on a CUDA group over NCCL (elsewhere, False).
    False by default: the pass fuses only compiled programs, and an eager program priced fused would be priced
    wrong.  The program's collectives are always in the form the pass fuses; eager programs run as without it."""
    price_at: Mapping[str, Any] | None = None
    """Input name -> the shape to price the plan at (``{"input_ids": (8, 4096)}``; None in a dim: the example's):
    capture at small example inputs, plan for the batch and sequence a run uses.  Only dims the capture made
    dynamic can differ from the example; None: price at the example inputs' sizes."""

    def __post_init__(self) -> None:
        if self.async_tp not in (None, True, False):
            raise ValueError(f"async_tp must be None, True or False, got {self.async_tp!r}")
        if self.sequence_parallel not in (None, True, False):
            raise ValueError(f"sequence_parallel must be None, True or False, got {self.sequence_parallel!r}")
        if self.recompute not in (None, "selective", False):
            raise ValueError(f'recompute must be None, "selective" or False, got {self.recompute!r}')
        if self.experts not in EXPERTS:
            raise ValueError(f'experts must be None, "tensor", "parallel" or "all-to-all", got {self.experts!r}')
        if not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"ep must be a positive number of ranks, got {self.ep!r}")
        if self.ep > 1 and self.experts == "parallel":
            raise ValueError(
                'experts="parallel" computes whole experts on the TP group alone; with a mesh\'s "ep" '
                'dimension choose "all-to-all" or "tensor" (or None)'
            )
        if self.fixed:
            try:
                object.__setattr__(
                    self, "fixed", {name: parse(p) if isinstance(p, str) else p for name, p in self.fixed.items()}
                )
            except (ValueError, AttributeError) as exc:
                raise ValueError(f'fixed maps parameter names to placements ("S(0)", "R", ...): {exc}') from None
        if self.parameter_sizes is not None and not all(
            isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in self.parameter_sizes.items()
        ):
            raise ValueError("parameter_sizes maps parameter names to numbers of elements (non-negative ints)")
        for name, shape in (self.price_at or {}).items():
            if (
                not isinstance(name, str)
                or not isinstance(shape, (tuple, list))
                or not all(d is None or (isinstance(d, int) and d >= 1) for d in shape)
            ):
                raise ValueError(
                    f"price_at maps input names to shapes of positive sizes (None: the example's), "
                    f"got {name!r}: {shape!r}"
                )
        if not self.expert_imbalance >= 1:
            raise ValueError(
                f"expert_imbalance is the busiest rank's load over the uniform share, at least 1: got "
                f"{self.expert_imbalance!r}"
            )


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How to run a plan on this rank's group: where the plan and the weights come from, and the checks."""

    plan: object = None
    """A Plan to run instead of solving one (``Plan.load``); None: rank 0 solves and shares it."""
    group: object = None
    """The process group to shard over; None: every rank (the default group)."""
    device: str | torch.device | None = None
    """Where this rank's shards live ("cuda", "cpu", a torch.device); None: this rank's GPU under a GPU group (NCCL,
    or "cpu:gloo,cuda:nccl": a CPU model's pieces are moved), else the model's own device where the group carries
    it, else the CPU.  A device the group does not carry is refused in one line (one rank excepted: it runs no
    collective)."""
    timeout: float = DEFAULT_TIMEOUT
    """Seconds a rank waits for the others (agreement, collectives) before it raises."""
    checkpoint: object = None
    """A safetensors directory (Hugging Face layout) or a torch.distributed.checkpoint directory, read per rank."""
    init_seed: int | None = None
    """Fill a meta-device model's pieces with its own initialisation for this seed (the same full model on any
    layout)."""
    check_inputs: str | bool = "first"
    """Ranks compare a digest of their input values (and, for a model that drops, their random states) on the
    "first" call, on "always", or never (False)."""
    verify: bool = False
    """Run the example inputs through both models and name the first diverging op (needs the model's weights)."""
    dropout: str = "default"
    """How dropout masks are drawn: "default" (Megatron's model-parallel streams) or "reference" (each rank its
    piece of the masks one process draws; for tests)."""
    recaptures: int = 8
    """Programs kept for inputs of a new structure (another BlockMask length, a length a shape guard of the
    capture excluded), each captured and planned again over the group, sharing the parameters; 0 refuses such
    inputs in one line."""

    def __post_init__(self) -> None:
        if self.check_inputs not in INPUT_CHECKS:
            raise ValueError(f'check_inputs must be "first", "always" or False, got {self.check_inputs!r}')
        if not isinstance(self.recaptures, int) or self.recaptures < 0:
            raise ValueError(f"recaptures must be a whole number >= 0, got {self.recaptures!r}")
        if self.dropout not in MODES:
            raise ValueError(f'dropout must be "default" or "reference" (for tests), got {self.dropout!r}')
        if self.device is not None:
            object.__setattr__(self, "device", parse_device(self.device))


@dataclass(frozen=True, kw_only=True)
class MeshOptions:
    """How a DeviceMesh composes the TP program: data parallelism, and pipeline stages on a "pp" dimension."""

    data_parallel: str = "fsdp"
    """Over "dp": "fsdp" (FSDP2 ``fully_shard`` per block) or "ddp"."""
    loss_fn: object = None
    """``loss_fn(output, target)``, computed by the last pipeline stage (needed with "pp")."""
    schedule: object = "1F1B"
    """A torch.distributed.pipelining schedule by name (case-insensitive) or class."""
    microbatches: int | None = None
    """Micro-batches per step (default: the number of pipeline ranks)."""
    stages: object = None
    """Stage boundaries as the block indices where stages start; None: priced by the cost model."""
    virtual_stages: int | None = None
    """Stages per rank of a multi-stage schedule."""

    def pipelined(self) -> bool:
        """Whether any option is for pipeline stages."""
        return (
            self.loss_fn is not None
            or self.microbatches is not None
            or self.stages is not None
            or self.virtual_stages is not None
        )


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """What ``autotp.plan_mesh`` searches: the cluster, the batch per step, the work and the expert traffic."""

    devices: int | None = None
    """Devices to lay out (default: all of the topology's)."""
    topology: str | Path | Topology | None = None
    """A topology profile's name, a JSON file's path or a loaded Topology; None: the default profile."""
    nodes: int | None = None
    """A cluster of that many of the topology's nodes."""
    global_batch: int | None = None
    """Samples per step (default: the example's)."""
    training: bool = True
    """Price a training step; False: inference."""
    data_parallel: str = "fsdp"
    """"fsdp" (parameters split over "dp") or "ddp" (replicated)."""
    memory_limit: float | None = None
    """Bytes per device; None: ``cost_models.memory.memory_limit``."""
    expert_imbalance: float = 1.0
    """Routed experts: the busiest rank's rows over the uniform top-k share."""
    overlap_all_to_all: float = 0.0
    """Routed experts: the share of the all-to-all time hidden behind compute (0: exposed; DualPipe hides most)."""
    async_tp: bool | None = False
    """Sequence-parallel layouts priced with their token collectives fused with their matmuls (PlanOptions'
    async_tp): True always, False never, None both, the faster kept."""

    def __post_init__(self) -> None:
        if self.async_tp not in (None, True, False):
            raise ValueError(f"async_tp must be None, True or False, got {self.async_tp!r}")
        if self.data_parallel not in ("fsdp", "ddp"):
            raise ValueError(f"data_parallel must be 'fsdp' or 'ddp', got {self.data_parallel!r}")
        if self.expert_imbalance < 1 or not 0 <= self.overlap_all_to_all <= 1:
            raise ValueError(
                f"expert_imbalance must be at least 1 (got {self.expert_imbalance}) and "
                f"overlap_all_to_all between 0 and 1 (got {self.overlap_all_to_all})"
            )


def parse_device(text: str | torch.device) -> torch.device:
    """A device as torch names it ("cuda", "cuda:1", "cpu"); anything else fails in one line."""
    try:
        return torch.device(text)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must name a device as torch does ('cuda', 'cuda:1', 'cpu'), got {text!r}") from None


def names(kind: Any) -> tuple[str, ...]:
    return tuple(f.name for f in fields(kind))


def from_keywords(
    keywords: dict[str, Any],
    kinds: tuple[type, ...] = (PlanOptions, RunOptions, MeshOptions),
    call: str = "parallelize",
) -> tuple[Any, ...]:
    """One value of each of ``kinds`` from a call's keywords; a keyword none of them has fails in one line."""
    known = {name: kind for kind in kinds for name in names(kind)}
    unknown = sorted(set(keywords) - known.keys())
    if unknown:
        raise TypeError(
            f"{call}() got unknown option(s) {', '.join(unknown)}: its options are {', '.join(sorted(known))}"
        )
    return tuple(kind(**{k: v for k, v in keywords.items() if known[k] is kind}) for kind in kinds)
