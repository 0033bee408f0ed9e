"""The pipeline in one place: capture -> prepare -> analyse -> candidates -> solve -> plan -> rewrite -> load.

``plan`` runs the stages up to the plan without any process group: passes/prepared_graph.py captures and prepares,
planning/tensor_plan.py analyses, enumerates the candidates, solves and writes the plan.  ``tensor_parallel`` has
the ranks agree on the model, rank 0 plan and share, then every rank rewrites its program and loads its pieces.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from autotp.ops.strategies import needs_grad
from autotp.options import PlanOptions, RunOptions, from_keywords
from autotp.passes.capture import fingerprint, retarget_device
from autotp.passes.prepared_graph import prepare, prepared_graph
from autotp.passes.recompute import attention_cores, checkpoint_cores
from autotp.passes.rewrite import rewrite
from autotp.placement import parse
from autotp.plan import Plan, PlanMismatch
from autotp.planning.plan_choice import Planned, planned
from autotp.planning.tensor_plan import solve_plan
from autotp.runtime.conversion import model_conversions
from autotp.runtime.dcp_checkpoint import DcpDirectory
from autotp.runtime.devices import shard_device
from autotp.runtime.dropout import set_mode
from autotp.runtime.expert_dispatch import Group, Groups
from autotp.runtime.hf_checkpoint import Checkpoint, check_tensors
from autotp.runtime.hf_models import default_inputs
from autotp.runtime.materialize import materialize
from autotp.runtime.programs import InputStructureError, install
from autotp.runtime.quantized import check_quantized, quantization, quantize_modules
from autotp.runtime.rendezvous import InputCheck, RandomCheck, Rendezvous, inputs_digest
from autotp.runtime.transport import enable_async_tp, fusable_async_tp, register


def plan(model: torch.nn.Module, args=None, kwargs=None, *, world_size: int, fold: bool = True, **options) -> Plan:
    """A sharding plan for ``world_size`` ranks without any process group (the model may be on the meta device).

    Costs are estimated at the example inputs' sizes: pass realistic ones (on the meta device they cost nothing).
    ``fold``: plan a long stack of identical blocks from four of them (same plan, time independent of depth;
    passes/fold.py).  ``options``: PlanOptions' fields (autotp/options.py)."""
    (planning,) = from_keywords(options, (PlanOptions,), "plan")
    return solve_plan(prepared_graph(model, args, kwargs, fold), world_size, planning, price_experts=True)


def tensor_parallel(
    model: torch.nn.Module,
    args,
    kwargs,
    planning: PlanOptions,
    running: RunOptions,
    *,
    graph: torch.fx.GraphModule | None = None,
    expert_groups: tuple | None = None,
    fill: bool = True,
) -> torch.nn.Module:
    """This rank's tensor-parallel copy of ``model`` over ``running.group``: same signature, full outputs on every
    rank (``autotp.parallelize`` without a mesh).  ``graph``: a captured part of ``model`` to shard instead (a
    pipeline stage, parallel/split.py).  ``expert_groups``: (a mesh's "ep" group, its "ep" x "tp" group), over which
    expert segments are dispatched.  ``fill=False`` leaves the checkpoint's and ``init_seed``'s tensors on meta,
    for the caller to fill once FSDP2 has split them (parallel/mesh.py)."""
    ranks = Ranks.of(running, expert_groups, graph, model)
    if planning.ep not in (1, ranks.ep):
        raise ValueError(
            f"ep={planning.ep}: a program's expert ranks are its mesh's \"ep\" dimension ({ranks.ep} "
            "here): give parallelize a mesh with an 'ep' dimension, or drop ep"
        )
    planning = replace(planning, ep=ranks.ep, async_tp=fusable_async_tp(planning.async_tp, ranks.group, ranks.device))
    if args is None and kwargs is None:
        args = default_inputs(model)
    gm = prepare(graph) if graph is not None else prepared_graph(model, args, kwargs)  # capture -> prepare
    graph_hash = fingerprint(gm)
    plan = agree_on_plan(gm, graph_hash, args, kwargs, planning, running.plan, ranks)  # analyse .. plan
    on_graph = planned(gm, plan, graph_hash, ranks.world)
    source = checkpoint_source(running.checkpoint, model)
    if source is not None:
        check_tensors(source, gm, names_of(model) if graph is not None else frozenset())
    sharded, dropouts = sharded_program(gm, on_graph, source, planning, running, ranks)  # rewrite
    sharded.autotp_plan, sharded.autotp_config = plan, getattr(model, "config", None)
    object.__setattr__(sharded, "autotp_source", model)  # for autotp.generate; not a submodule
    if fill and (source is not None or running.init_seed is not None):  # load
        materialize(sharded, ranks.device, checkpoint=source, seed=running.init_seed)
    ranks.planners.agree("loaded", "ok", "the end of loading")
    if planning.async_tp or plan.cost.get("async_tp", {}).get("chosen"):
        enable_async_tp(ranks.group, ranks.device)
    if running.check_inputs:
        InputCheck(ranks.everyone, every_call=running.check_inputs == "always").attach(sharded)
        if dropouts:
            RandomCheck(ranks.everyone, running.check_inputs == "always", dropouts, ranks.device).attach(sharded)
    if running.verify:
        verify_against(model, sharded, args, kwargs)
    if graph is None:  # a pipeline stage's inputs are its schedule's, of one structure
        make = functools.partial(another_program, model, plan, planning, running, expert_groups)
        sharded.autotp_programs = install(sharded, make, running.recaptures)
    return sharded


def another_program(
    model: torch.nn.Module,
    first: Plan,
    planning: PlanOptions,
    running: RunOptions,
    expert_groups: tuple | None,
    args,
    kwargs,
    training: bool,
) -> torch.nn.Module:
    """A program for inputs of a structure the first program's capture excluded, made as the first was (every rank
    of the group at once, rank 0 planning): the first plan where it fits the new graph, else a plan whose
    parameters are placed as the first plan places them, so that both programs hold the same pieces; captured
    in ``training`` mode (the user's model is left in its own)."""
    ranks = Ranks.of(running, expert_groups, None, model)
    modes = {module: module.training for module in model.modules()}
    model.train(training)
    try:
        gm = prepared_graph(model, args, kwargs)
    finally:
        for module, mode in modes.items():
            module.training = mode
    graph_hash = fingerprint(gm)
    try:
        planned(gm, first, graph_hash, ranks.world)
        given = first
    except PlanMismatch:
        given = None
    fixed = {name: parse(text) for name, text in first.params.items()}
    plan = agree_on_plan(gm, graph_hash, args, kwargs, replace(planning, fixed=fixed), given, ranks)
    moved = [name for name, text in plan.params.items() if first.params.get(name, text) != text]
    if moved:
        raise InputStructureError(
            f"the plan for these inputs places {moved[0]} as {plan.params[moved[0]]}, the "
            f"first as {first.params[moved[0]]}: the programs cannot share their pieces; "
            "parallelize with inputs of this structure instead"
        )
    program, _ = sharded_program(gm, planned(gm, plan, graph_hash, ranks.world), None, planning, running, ranks)
    ranks.planners.agree("loaded", "ok", "the end of loading")
    return program.train(training)


@dataclass(frozen=True)
class Ranks:
    """The groups one ``tensor_parallel`` call runs over, and their rendezvous: ``everyone`` over the TP group,
    ``planners`` over the ranks that must hold one plan (the "ep" x "tp" ranks with experts dispatched)."""

    group: object  # the TP group
    rank: int
    world: int
    ep_group: object  # a mesh's "ep" group, or None
    routed_group: object  # the "ep" x "tp" ranks experts are dispatched over (the TP group without "ep")
    groups: Groups
    everyone: Rendezvous
    planners: Rendezvous
    device: torch.device

    @property
    def ep(self) -> int:
        return dist.get_world_size(self.ep_group) if self.ep_group is not None else 1

    @classmethod
    def of(cls, running: RunOptions, expert_groups: tuple | None, graph, model: torch.nn.Module) -> Ranks:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "autotp.parallelize needs torch.distributed: call dist.init_process_group(...) first "
                "(launch with torchrun), or use autotp.plan(...) to inspect a plan without one"
            )
        if running.verify and graph is not None:
            raise ValueError(
                "verify=True compares a whole model with its sharded program: verify without pipeline "
                "stages (a mesh without 'pp')"
            )
        group = running.group or dist.group.WORLD
        device = shard_device(group, model, running.device)  # before any capture: a device the group carries
        ep_group, routed_group = expert_groups or (None, group)
        everyone = Rendezvous(group, running.timeout)
        planners = Rendezvous(routed_group, running.timeout) if ep_group is not None else everyone
        groups = Groups(_group(routed_group), _group(ep_group) if ep_group is not None else None)
        return cls(
            group,
            dist.get_rank(group),
            dist.get_world_size(group),
            ep_group,
            routed_group,
            groups,
            everyone,
            planners,
            device,
        )


def agree_on_plan(
    gm: torch.fx.GraphModule, graph_hash: str, args, kwargs, planning: PlanOptions, given: Plan | None, ranks: Ranks
) -> Plan:
    """The one plan every rank runs: they agree on the model and input shapes, rank 0 solves the plan (unless one
    is ``given``) and shares it, they agree on its text, and its expert mesh is this mesh's."""
    ranks.planners.agree("model", f"{graph_hash}/{inputs_digest(args, kwargs)}", "the model and input shapes")
    if given is None:
        text = ranks.planners.share("plan", lambda: solve_plan(gm, ranks.world, planning, price_experts=True).to_json())
        plan = Plan.from_json(text, validate=False)
    else:
        plan, text = given, given.to_json()
    ranks.planners.agree("plan", hashlib.sha256(text.encode()).hexdigest()[:16], "the plan")
    if plan.mesh.get("ep", 1) != planning.ep:
        raise PlanMismatch(
            f'the plan dispatches experts over {plan.mesh.get("ep", 1)} "ep" ranks, the mesh has '
            f"{planning.ep}: re-plan for this mesh"
        )
    return plan


def sharded_program(
    gm: torch.fx.GraphModule, on_graph: Planned, source, planning: PlanOptions, running: RunOptions, ranks: Ranks
) -> tuple[torch.nn.Module, list]:
    """This rank's program: the graph rewritten with its collectives, the planned attention cores recomputed,
    dropout drawn as ``running.dropout`` says; with its random ops (for the ranks' random-state check)."""
    again = [core for core in attention_cores(gm, needs_grad(gm)) if core[-1] in on_graph.recomputed]
    retarget_device(gm, ranks.device)  # the capture's device named in factory calls: the program runs on the shards'
    tp = Group(ranks.group.group_name, ranks.rank, ranks.world)
    provided = frozenset(source.files) if source else frozenset()
    sharded = rewrite(
        gm,
        on_graph.choice,
        tp,
        dispatch=ranks.groups,
        device=ranks.device,
        provided=provided,
        gather_outputs=planning.gather_outputs,
        regathered=on_graph.regathered,
    )
    checkpoint_cores(sharded, again)
    dropouts = set_mode(sharded, running.dropout)
    for member in {ranks.group, ranks.routed_group, ranks.ep_group} - {None}:
        register(member)
    sharded.autotp_group, sharded.autotp_experts, sharded.autotp_device = ranks.group, ranks.groups, ranks.device
    return sharded, dropouts


def verify_against(model: torch.nn.Module, sharded: torch.nn.Module, args, kwargs) -> None:
    """Run the example inputs through both and name the first op whose values differ (passes/verify.py)."""
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(
            "verify=True compares with the unsharded model, whose weights are on the meta device: "
            "verify with a model that fits in memory, or drop verify"
        )
    from autotp.passes.verify import verify

    verify(sharded, prepared_graph(model, args, kwargs), args, kwargs)


def checkpoint_source(checkpoint, model: torch.nn.Module):
    """``checkpoint=`` as a source of pieces: a safetensors directory read through ``model``'s stored layout, a
    torch.distributed.checkpoint directory, or an object that reads pieces itself (generation's resident shards)."""
    if checkpoint is None or hasattr(checkpoint, "read_box") or hasattr(checkpoint, "load"):
        return checkpoint
    if (Path(checkpoint) / ".metadata").exists():
        return DcpDirectory(checkpoint, names_of(model))
    return Checkpoint(checkpoint, model_conversions(model))


def names_of(model: torch.nn.Module) -> frozenset:
    """Every name of ``model``'s parameters and buffers, tied ones under each name."""
    return frozenset(
        name
        for name, _ in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    )


def from_pretrained(directory, *, dtype: torch.dtype | None = None, **options) -> torch.nn.Module:
    """A Hugging Face causal LM directory, sharded: built on the meta device, each rank reading only its own slices
    of the safetensors files.  ``options``: PlanOptions' and RunOptions' fields (autotp/options.py)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    if "checkpoint" in options:
        raise TypeError("from_pretrained() reads its checkpoint from the directory: drop checkpoint=")
    planning, running = from_keywords(options, (PlanOptions, RunOptions), "from_pretrained")
    config = AutoConfig.from_pretrained(directory)
    scheme = quantization(config)  # a format autotp does not read is refused here, before any rank loads
    with init_empty_weights(include_buffers=False):  # computed buffers (rotary tables) stay real
        model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    model.tie_weights()  # transformers ties input/output embeddings only when asked, on empty weights
    quantize_modules(model, scheme)  # linears stored quantized hold their stored tensors (runtime/quantized.py)
    if scheme is not None:
        check_quantized(Checkpoint(directory), model, scheme)
    return tensor_parallel(model.eval(), None, None, planning, replace(running, checkpoint=directory))


def _group(group) -> Group:
    return Group(group.group_name, dist.get_rank(group), dist.get_world_size(group))
