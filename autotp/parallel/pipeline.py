"""Pipeline stages on torch.distributed.pipelining, each stage sharded by a caller-given function (autotp's TP).

Each rank captures and builds only the stages it holds (split.py: the model with only those blocks in its block
list, cut between blocks; any device, meta included), keeping every parameter's original name.  Each stage goes
through ``shard_stage`` (TP on the stage's graph, FSDP over data parallel), is wrapped in a ``PipelineStage`` and
driven by one of pipelining's schedules.  Micro-batch losses are averaged the way a single-process mean loss is: the
schedule divides gradients by the number of micro-batches (``scale_grads``).

A weight read by two stages (tied input and output embeddings) is held by both, split alike over TP (tied.py);
after each step's backward the copies' gradients are summed over
the pipeline ranks holding them at the same (dp, tp) place (Megatron's embedding group), so the copies stay equal;
a checkpoint or ``init_seed`` fills both from the one stored or seeded tensor, and saving writes it once.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from autotp.cost_models import load_topology
from autotp.cost_models.memory import memory_limit as device_limit
from autotp.cost_models.mesh_layout import Candidate, Setting
from autotp.options import MeshOptions, PlanOptions
from autotp.parallel.schedules import check_evaluates, resolve, step_failure
from autotp.parallel.split import stage_graph
from autotp.parallel.stages import StageError, block_profile, find_blocks, stage_starts
from autotp.parallel.tied import Tied
from autotp.passes.prepared_graph import prepared_graph
from autotp.planning.analysis import offered
from autotp.runtime.conversion import on_meta, weightless
from autotp.runtime.devices import device_of
from autotp.runtime.hf_checkpoint import full_checkpoint_tensors, full_state_dict
from autotp.runtime.rendezvous import InputCheck


def pipeline(
    model: torch.nn.Module,
    args,
    kwargs=None,
    *,
    mesh,
    meshing: MeshOptions,
    planning: PlanOptions | None = None,
    shard_stage=None,
) -> Pipelined:
    """This rank's pipeline stages of ``model`` over ``mesh["pp"]``, ready to train with ``step``, as ``meshing``
    says (its loss, schedule, micro-batches, stage starts, virtual stages and data parallelism).

    ``args`` / ``kwargs``: example inputs of one step on this data-parallel rank (its share of the batch);
    they are cut into ``meshing.microbatches`` along dim 0 (default: one per pipeline rank).  ``meshing.stages``:
    the block indices where stages begin (first 0), overriding the cost model's split (stage time balanced under
    ``planning.memory_limit`` bytes per device, default 90% of its topology's, with ``meshing.data_parallel``
    sharding over the mesh's "dp"; ``planning``, the user's plan options, also decide the tied weights'
    placements).  ``meshing.schedule``: a torch.distributed.pipelining name or class (parallel/schedules.py);
    multi-stage schedules hold ``meshing.virtual_stages`` stages per rank (default: ``len(stages) / pp`` when
    stages are given, else 2).  ``shard_stage(model, args, kwargs, graph=, fixed=) -> module`` shards one stage's
    graph (``fixed``: placements its tied weights must take; default: the graph itself).
    """
    loss_fn, schedule, microbatches = meshing.loss_fn, meshing.schedule, meshing.microbatches
    stages, virtual_stages, data_parallel = meshing.stages, meshing.virtual_stages, meshing.data_parallel
    if "pp" not in (mesh.mesh_dim_names or ()):
        raise ValueError(f"pipeline needs a mesh with a 'pp' dimension, got dims {mesh.mesh_dim_names}")
    if not callable(loss_fn):
        raise TypeError("pipeline stages need loss_fn(output, target): the last stage computes each micro-batch's loss")
    if args is None and not kwargs:
        raise TypeError("pipeline needs example inputs of one step on this data-parallel rank: pass args")
    pp_mesh = mesh["pp"]
    group, pp, pp_rank = pp_mesh.get_group(), pp_mesh.size(), pp_mesh.get_local_rank()
    plan = resolve(schedule, virtual_stages)
    if stages is not None and virtual_stages is None and not plan.single and len(stages) % pp == 0:
        plan = resolve(schedule, len(stages) // pp or None)  # the stages listed say how many each rank holds
    count = plan.stages(pp)
    microbatches = microbatches or pp
    plan.check(pp, microbatches)
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    mb_args, mb_kwargs = _first_microbatch(args, kwargs, microbatches)
    fold = find_blocks(model)
    tp, dp = (mesh[d].size() if d in mesh.mesh_dim_names else 1 for d in ("tp", "dp"))
    whole = _Whole(model, mb_args, mb_kwargs)
    planning = planning or PlanOptions()
    if stages is None:
        topo, size = load_topology(planning.topology), _batch_size(mb_args, mb_kwargs)
        limit = device_limit(topo, planning.memory_limit)
        stages = stage_starts(
            block_profile(whole.graph(), fold, tp, topo),
            Candidate(tp, pp, dp, microbatch_size=size, schedule=plan.cls, virtual_stages=plan.per_rank),
            Setting(topo, size * microbatches * dp, True, data_parallel, limit, 0.0),
        )
    stages = _checked_starts(list(stages), count, fold.count, plan.name)
    bounds = [*stages, fold.count]
    skeleton = on_meta(model)  # what the stages keep of the model: its classes and config, no weights
    shard_stage = shard_stage or (lambda model, args, kwargs, graph, fixed: graph)
    device = device_of(group)
    modules, built, tied = {}, [], Tied(model, count)
    for index in plan.stage_indices(pp, pp_rank):
        stage = stage_graph(model, mb_args, mb_kwargs, fold.path, fold.count, bounds[index], bounds[index + 1])
        tied.read(stage)
        fixed = tied.placements(stage.graph, lambda: offered(whole.graph(), tp, planning)) if tp > 1 else {}
        modules[index] = shard_stage(skeleton, stage.args, stage.kwargs, graph=stage.graph, fixed=fixed or None)
        _check_inputs_once(modules[index], stage.args, stage.kwargs, index == 0)
        built.append(PipelineStage(modules[index], index, count, device, group=group))
    tied.connect(mesh, plan.placement(pp).__getitem__)
    out_spec = stage.out_spec

    def flat_loss(output, target):
        return loss_fn(_unflatten(output, out_spec), target)

    runner = plan.build(built, microbatches, flat_loss)
    return Pipelined(
        runner,
        modules,
        group,
        out_spec,
        stages,
        getattr(model, "config", None),
        weightless(model),
        frozenset(model.state_dict()),
        plan.placement(pp),
        tied,
    )


class _Whole:
    """The model's folded graph (four blocks, passes/fold.py), captured when first needed: to split the stages and
    to see every reader of a tied weight."""

    def __init__(self, model: torch.nn.Module, args: tuple, kwargs: dict):
        self.model, self.args, self.kwargs, self.gm = model, args, kwargs, None

    def graph(self) -> torch.fx.GraphModule:
        if self.gm is None:
            self.gm = prepared_graph(self.model, self.args, self.kwargs, fold=True)
        return self.gm


class Pipelined:
    """This rank's stages and the schedule that runs them; the parameters keep their original names."""

    def __init__(
        self,
        schedule,
        modules: dict,
        group,
        out_spec,
        starts: list,
        config=None,
        source=None,
        stored: frozenset = frozenset(),
        placement: tuple = (),
        tied: Tied | None = None,
    ):
        self.schedule = schedule
        self.placement = placement  # stage index -> the pipeline rank that holds it
        self.tied = tied  # weights held by two stages: their gradients are summed after each backward
        self.stored = stored  # the model's parameter and persistent buffer names: what a checkpoint holds
        self.autotp_config = config  # written beside the weights by autotp.save_pretrained
        self.autotp_source = source  # the model without its weights: save_pretrained writes transformers' layout of it
        self.modules = modules  # stage index -> this rank's (sharded) stage module
        self.group = group
        self.out_spec = out_spec
        self.starts = starts  # block index where each stage begins

    def step(self, *inputs, target=None, losses: list | None = None, **kwargs):
        """One training step's forward and backward over the micro-batches (the optimizer step is the caller's):
        inputs matter on the first stage, ``target`` on the last, where ``losses`` gets each micro-batch's loss
        and the merged output is returned (None elsewhere).  A send, receive or collective that fails or outlives
        the timeout raises a CollectiveError naming this rank's stages, the mesh dimension and the peers."""
        try:
            merged = self.schedule.step(*inputs, target=target, losses=losses, **kwargs)
            if self.tied is not None:
                self.tied.sum_gradients(self.modules.values())
        except Exception as exc:
            raise step_failure(exc, sorted(self.modules), self.placement, self.group) from exc
        return self._output(merged)

    def evaluate(self, *inputs, target=None, losses: list | None = None, **kwargs):
        """Forward only (no gradients kept): the merged output on the last stage, losses if ``target`` is given."""
        check_evaluates(self.schedule)
        with torch.no_grad():
            return self._output(self.schedule.eval(*inputs, target=target, losses=losses, **kwargs))

    def named_parameters(self):
        for index in sorted(self.modules):
            for name, param in self.modules[index].named_parameters():
                yield self.autotp_canonical(name), param

    def parameters(self):
        for _, param in self.named_parameters():
            yield param

    def full_state_dict(self, buffers: bool = False) -> dict:
        """Every stage's full parameters (and persistent buffers, for a checkpoint) by original name, on every rank
        of this pipeline (a collective over the pipeline group and each stage's TP and DP groups)."""
        mine = {}
        for index in sorted(self.modules):  # the cut loses which buffers were persistent: the model says
            full = _full_tensors(self.modules[index], buffers)
            mine.update(
                (self.autotp_canonical(name), t) for name, t in full.items() if not buffers or name in self.stored
            )
        everyone = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        return {name: tensor for stage in everyone for name, tensor in stage.items()}

    @property
    def autotp_stages(self) -> dict:
        """Stage index -> this rank's stage module, what a checkpoint reads and fills (runtime/dcp_checkpoint.py)."""
        return self.modules

    def autotp_canonical(self, name: str) -> str:
        """A tied weight once, under its first name."""
        return name if self.tied is None else self.tied.canonical(name)

    def _output(self, merged):
        return None if merged is None else _unflatten(merged, self.out_spec)


def _check_inputs_once(module: torch.nn.Module, args: tuple, kwargs: dict, first: bool) -> None:
    """autotp's check that TP ranks agree on a stage's first inputs, run now on the example's values: pipelining's
    shape inference makes the first call of a later stage with uninitialized tensors, which ranks would not agree
    on (and a later stage's inputs come from the stage before, the same on every TP rank)."""
    real = first and not any(t.is_meta for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
    for hook in list(module._forward_pre_hooks.values()):
        if isinstance(hook, InputCheck):
            if real:
                hook(module, args, kwargs)
            else:
                hook.handle.remove()


def _full_tensors(module: torch.nn.Module, buffers: bool) -> dict:
    """One stage's full parameters (and persistent buffers): autotp's gather (over DP, then TP) for a sharded
    stage; a stage left unsharded by ``shard_stage`` holds them whole (FSDP's DTensors gathered)."""
    if hasattr(module, "autotp_group"):
        return dict(full_checkpoint_tensors(module)) if buffers else full_state_dict(module)
    named = [*module.named_parameters(), *(module.named_buffers() if buffers else ())]
    return {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for name, t in named}


def _batch_size(args: tuple, kwargs: dict) -> int | None:
    return next((t.shape[0] for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim()), None)


def _first_microbatch(args: tuple, kwargs: dict, microbatches: int) -> tuple:
    """One micro-batch of the example inputs: the shapes every stage is exported and sharded at."""
    batch = _batch_size(args, kwargs)
    if not isinstance(microbatches, int) or microbatches < 1 or batch is None or batch % microbatches:
        raise ValueError(
            f"the batch ({batch}) must divide into {microbatches} equal micro-batches: "
            "pass a batch that is a multiple of microbatches"
        )
    chunks_args, chunks_kwargs = split_args_kwargs_into_chunks(args, kwargs, microbatches)
    return chunks_args[0], chunks_kwargs[0]


def _checked_starts(starts: list, count: int, blocks: int, schedule: str) -> list:
    if (
        len(starts) != count
        or starts[0] != 0
        or any(b <= a for a, b in itertools.pairwise(starts))
        or starts[-1] >= blocks
    ):
        raise StageError(
            f"stages={starts}: the {schedule} schedule on this mesh runs {count} stages; give the block "
            f"index where each begins, increasing from 0 and below {blocks}"
        )
    return starts


def _unflatten(output, spec):
    leaves = list(output) if isinstance(output, (tuple, list)) else [output]
    if spec.num_leaves != len(leaves):
        raise RuntimeError(f"the last stage returned {len(leaves)} tensors, the model returns {spec.num_leaves}")
    return tree_unflatten(leaves, spec)
