"""The pipeline in one place: capture -> rules -> cost -> solve -> rewrite -> load."""
from __future__ import annotations

import hashlib
import warnings
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from autotp.cost_models import load_topology
from autotp.cost_models.pricing import Experts, Sizes, activation_bytes
from autotp.ops import expert_segments
from autotp.ops.strategies import Context, Strategy, enumerate_strategies, input_slots, needs_grad, on_tokens
from autotp.ops.table import TABLE, drops
from autotp.options import Options
from autotp.parallel.dcp import DcpDirectory
from autotp.passes.capture import CaptureError, canonical_names, capture, fingerprint, module_path, retarget_device
from autotp.passes.capture import check_inputs as check_example_inputs
from autotp.passes.fold import Fold, NotFoldable, find_fold, fold_graph, folded
from autotp.passes.group_cuts import cuts_to_gathers
from autotp.passes.prepare import (
    add_hints,
    drop_no_ops,
    fuse_repeat_kv,
    merge_aliases,
    split_bias,
    unflatten_products,
)
from autotp.passes.recompute import attention_cores, checkpoint_cores
from autotp.passes.rewrite import rewrite
from autotp.passes.styles import param_styles
from autotp.passes.unmerge import unmerge
from autotp.placement import Disjoint, Routed, Shard
from autotp.plan import Plan, PlanMismatch
from autotp.planning.accounting import alternatives, planned_collectives
from autotp.planning.solve import DoesNotFit, PlanningError, solve
from autotp.runtime.conversion import model_conversions
from autotp.runtime.dropout import set_mode
from autotp.runtime.expert_dispatch import Group, Groups
from autotp.runtime.hf_checkpoint import Checkpoint, check_tensors
from autotp.runtime.hf_models import default_inputs, no_kv_cache
from autotp.runtime.materialize import device_of, materialize
from autotp.runtime.rendezvous import DEFAULT_TIMEOUT, InputCheck, RandomCheck, Rendezvous, inputs_digest
from autotp.runtime.transport import register


def prepared_graph(model: torch.nn.Module, args=None, kwargs=None, fold: bool = False) -> torch.fx.GraphModule:
    """The captured graph, prepared for the rules.  ``fold=True``: a long list of identical blocks is captured as
    four of them (passes/fold.py; ``gm.meta["autotp_fold"]`` says how), for planning only -- never for running."""
    if args is None and kwargs is None:
        args = default_inputs(model)
    repeats = None
    if fold:
        check_example_inputs(model, args if args is not None else (), kwargs)  # clear errors before looking inside
        repeats = find_fold(model)
    if repeats is not None:
        try:
            with folded(model, repeats):
                gm = prepared_graph(model, args, kwargs)
            gm.meta["autotp_fold"] = fold_graph(gm, repeats)
            return gm
        except (CaptureError, NotFoldable):
            pass  # the forward needs every block (e.g. indexes the list), or they differ: capture them all
    with no_kv_cache(model):
        return prepare(capture(model, args if args is not None else (), kwargs))


def prepare(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A captured graph (of a model, or of one pipeline stage: parallel/split.py) made ready for the rules."""
    merge_aliases(gm)
    split_bias(gm)
    unflatten_products(gm)
    fuse_repeat_kv(gm)
    drop_no_ops(gm)
    unmerge(gm)
    cuts_to_gathers(gm)
    canonical_names(gm)
    return gm


def solve_plan(gm: torch.fx.GraphModule, world_size: int, options: Options | None = None, *,
               sizes: Sizes | None = None, price_experts: bool = False) -> Plan:
    """The plan for ``world_size`` ranks.  Sequence parallelism and recomputation are tried in Korthikanti et
    al.'s order when ``options`` leave them open (None) and the plain plan does not fit; ``price_experts``: also
    solve with each expert strategy imposed, keep the cheapest plan and list them (``plan.cost["experts"]``)."""
    options = options or Options()
    sequence_parallel, recompute = options.sequence_parallel, options.recompute
    tries = [(tokens, "forced" if recompute else "off") for tokens in
             ([bool(sequence_parallel)] if sequence_parallel is not None else [False, True])]
    if recompute is None:
        tries.append((tries[-1][0], "priced"))
    if not options.training:
        tries = tries[:1]
    for k, (tokens, again) in enumerate(tries):
        try:
            return _solve_once(gm, world_size, options, sizes, tokens, again, price_experts)
        except DoesNotFit:
            if k == len(tries) - 1:
                raise


def _solve_once(gm: torch.fx.GraphModule, world_size: int, options: Options, sizes: Sizes | None, tokens: bool,
                recompute: str, price_experts: bool) -> Plan:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    topo = load_topology(options.topology)
    if world_size > topo.devices:
        raise ValueError(f"world size {world_size} is larger than topology {topo.name} ({topo.devices} devices): "
                         "pick a topology with more devices (e.g. 2x-dgx-h100) or a smaller world size")
    if options.ep > 1 and world_size == 1 and options.experts is None:
        options = replace(options, experts="all-to-all")  # no TP to split experts over: whole, dealt over "ep"
    ctx = _strategies(gm, world_size, options, tokens, options.experts)
    sizes = Sizes(sizes.overrides if sizes else None, Experts(options.expert_imbalance, options.ep, ctx.segments))
    folding = gm.meta.get("autotp_fold")
    if folding and any(ctx.strategies.get(a) != ctx.strategies.get(b) for a, b in folding.ties):
        raise PlanningError(f"the blocks of {folding.fold.path} look identical but offer different shardings: "
                            "plan with fold=False")
    if ctx.unruled:
        warnings.warn(f"autotp: {len(ctx.unruled)} op(s) on the weights' path run replicated (correct, possibly "
                      f"slower): {'; '.join(f'{op}: {why}' for op, why in sorted(ctx.unruled.items()))}", stacklevel=4)
    weights = folding.weights if folding else None
    training = options.training

    def run(ctx: Context):
        return solve(gm, ctx, topo, training=training, memory_limit=options.memory_limit, sizes=sizes,
                     gather_outputs=options.gather_outputs, weights=weights, ties=folding.ties if folding else (),
                     sequence_parallel=bool(options.sequence_parallel), recompute=recompute)
    solution, experts_cost = run(ctx), None
    offered = ctx.segments or any(isinstance(s.output, Disjoint) for found in ctx.strategies.values() for s in found)
    if offered and price_experts and not options.fixed and not options.experts:
        ctx, solution, experts_cost = _cheapest_experts(
            ctx, solution, options.ep, lambda mode: _priced(run, _strategies(gm, world_size, options, tokens, mode)))
    choice = solution.choice
    _check_experts(ctx, choice, options)
    again = {node for core in solution.recomputed for node in core}
    expand = folding.fold.expand if folding else dict
    return Plan(
        world_size=world_size,
        fingerprint=folding.fingerprint(gm) if folding else fingerprint(gm),
        topology=topo.name,
        nodes={n.name: {**Plan.encode(s), "module": module_path(n), "op": str(n.target),
                        "args": [a.name for a in input_slots(n)], **({"recompute": True} if n in again else {}),
                        **({"key": folding.blocks.key[n]} if folding else {})} for n, s in choice.items()},
        params=expand({n.target: str(s.output) for n, s in choice.items() if n.op == "get_attr"}),
        collectives=planned_collectives(gm, choice, world_size, topo, sizes, weights),
        styles=expand(param_styles(gm, choice, world_size)),
        shapes=expand({n.target: list(n.meta["val"].shape) for n in choice if n.op == "get_attr"}),
        alternatives=alternatives(gm, ctx, choice, topo, training, sizes),
        cost={"seconds": solution.seconds, "compute_seconds": solution.compute, "memory": solution.memory,
              "training": training,
              "regathers": [{"tensor": n.name, **priced} for n, priced in solution.regathers.items()],
              **_activations_by_module(gm, choice, sizes, world_size, training, solution.recomputed),
              **({"experts": experts_cost} if experts_cost else {}),
              **({"replicated": dict(sorted(ctx.unruled.items()))} if ctx.unruled else {})},
        replicated_ops=sorted(ctx.unruled),
        mesh={"tp": world_size, **({"ep": options.ep} if options.ep > 1 else {})},
        fold=({"path": folding.fold.path, "count": folding.fold.count,
               **({"start": folding.fold.start} if folding.fold.start else {})} if folding else None),
    )


def offered(gm: torch.fx.GraphModule, world_size: int, options: Options | None = None) -> dict:
    """Parameter name -> the placements the solver may give it on ``world_size`` ranks (each one every reader of
    the parameter takes without moving it)."""
    options = options or Options()
    ctx = _strategies(gm, world_size, options, False, options.experts)
    return {n.target: [s.output for s in ctx.strategies[n]] for n in gm.graph.nodes
            if n.op == "get_attr" and n in ctx.strategies}


def _strategies(gm: torch.fx.GraphModule, world_size: int, options: Options, tokens: bool,
                experts: str | None) -> Context:
    ctx = Context(world=world_size, min_shard_fraction=options.min_shard_fraction, fixed=options.fixed or {},
                  tokens=tokens, experts=experts, ep=options.ep, ops=TABLE)
    ctx.segments = expert_segments.members(expert_segments.find(gm, ctx))
    add_hints(gm, ctx)
    enumerate_strategies(gm, ctx)
    return ctx


def _check_experts(ctx: Context, choice: dict, options: Options) -> None:
    """Experts imposed "all-to-all", or a mesh's "ep" ranks to dispatch them over, need segments that can be."""
    found = {s.exit: s for s in ctx.segments.values()}
    if options.experts == "all-to-all" and not (found and all(isinstance(choice[e].output, Routed) for e in found)):
        raise PlanningError('experts="all-to-all": no plan dispatches every expert segment (each needs at least as '
                            'many experts as dispatch ranks, and ops that keep rows): choose another expert strategy')
    if options.ep > 1 and not found:
        raise PlanningError(f'the mesh has an "ep" dimension of {options.ep} ranks, but this model has no expert layer '
                            'autotp can dispatch (grouped matmuls or w[ids] + bmm, routed rows in, one result out): '
                            'drop the "ep" dimension')


def _priced(run, ctx: Context):
    """(ctx, its solution), or None where no plan of it fits or dispatches as imposed."""
    try:
        return ctx, run(ctx)
    except PlanningError:
        return None


def _cheapest_experts(ctx: Context, solution, ep: int, imposed) -> tuple:
    """The cheapest of the plan solved with the expert strategy left free and the plans with each imposed (the
    free solve keeps large parameters sharded wherever a shard suits all their users, which can rule out a mix
    that an imposed strategy reaches); with how the chosen plan holds its experts (3-D parameters): whole experts
    computing their rows in place ("parallel"), whole experts fed by all-to-all ("all-to-all"), each expert split
    ("tensor"), several ("mixed") or none ("replicated"), and each strategy's estimated step time (None where
    none fits), for reports."""
    seconds = {}
    for mode in ("tensor", "all-to-all") if ep > 1 else ("tensor", "parallel", "all-to-all"):
        found = imposed(mode)
        seconds[mode] = None if found is None else found[1].seconds
        if found is not None and found[1].seconds < solution.seconds * (1 - 1e-9):
            ctx, solution = found
    kinds = {"all-to-all" if isinstance(s.output, Routed) else "parallel" if s.output.dim == 0 else "tensor"
             for n, s in solution.choice.items() if n.op == "get_attr" and n.meta["val"].dim() == 3 and
             isinstance(s.output, (Shard, Routed))}
    none = "all-to-all" if ep > 1 else "replicated"  # over "ep" alone: whole experts, dispatched there
    return ctx, solution, {"chosen": kinds.pop() if len(kinds) == 1 else "mixed" if kinds else none,
                           "seconds": seconds}


def _activations_by_module(gm: torch.fx.GraphModule, choice: dict, sizes: Sizes | None, world: int,
                           training: bool, recomputed: list) -> dict:
    """Bytes kept for backward per device by the module that computes them, the modules that split
    the tokens (sequence parallelism) and those whose attention core is recomputed, for reports."""
    kept: dict = {}
    grad = needs_grad(gm) if training else set()
    for node, held in activation_bytes(choice, sizes or Sizes(), world, grad, recomputed).items():
        kept[module_path(node)] = kept.get(module_path(node), 0.0) + held
    split = sorted({module_path(n) for n, s in choice.items() if on_tokens(n, s)})
    return {"activations": kept, "token_split": split,
            "recompute": sorted({module_path(core[-1]) for core in recomputed}),
            "dropout": sorted({module_path(n) for n in choice if drops(n)})}


def plan(model: torch.nn.Module, args=None, kwargs=None, *, world_size: int, topology=None,
         min_shard_fraction: float = 0.02, training: bool = True, memory_limit: float | None = None,
         fold: bool = True, sequence_parallel: bool | None = None, recompute: str | bool | None = None,
         experts: str | None = None, ep: int = 1) -> Plan:
    """Find a sharding plan without any process group (the model may be on the meta device).

    Costs are estimated at the example inputs' sizes: pass realistic ones (on the meta device
    they cost nothing).  ``memory_limit``: bytes per device (default 90% of the topology's).
    ``fold``: plan a long stack of identical blocks from four of them (same plan, time independent of
    depth; see passes/fold.py); ``fold=False`` captures and solves every block.  ``sequence_parallel``:
    split the norms, dropouts and residual adds by tokens (Megatron's sequence parallelism): True,
    False, or None to take it only when memory demands it.  ``recompute``: recompute the attention cores
    in the backward instead of keeping their scores (Megatron's selective recomputation): "selective",
    False, or None to take it where memory demands it (after sequence parallelism).  ``experts``: how
    mixture-of-experts layers are split: "parallel" (whole experts per rank, computing their rows in place),
    "all-to-all" (whole experts per rank, rows sent to their owners), "tensor" (every expert split
    Megatron-style), or None to let the cost model choose (``plan.cost["experts"]`` prices each).  ``ep``: the
    ranks of a mesh's "ep" dimension the experts are dispatched over too (parallel/mesh.py).
    """
    options = Options(topology=topology, min_shard_fraction=min_shard_fraction, training=training,
                      memory_limit=memory_limit, sequence_parallel=sequence_parallel, recompute=recompute,
                      experts=experts, ep=ep)
    return solve_plan(prepared_graph(model, args, kwargs, fold), world_size, options, price_experts=True)


def tensor_parallel(model: torch.nn.Module, args=None, kwargs=None, *, plan: Plan | None = None, topology=None,
                    group=None, checkpoint=None, init_seed: int | None = None,
                    min_shard_fraction: float = 0.02, training: bool = True,
                    memory_limit: float | None = None, timeout: float = DEFAULT_TIMEOUT, gather_outputs: bool = True,
                    fixed: dict | None = None, check_inputs: str | bool = "first",
                    verify: bool = False, sequence_parallel: bool | None = None,
                    recompute: str | bool | None = None, experts: str | None = None,
                    dropout: str = "default", expert_groups: tuple | None = None,
                    graph: torch.fx.GraphModule | None = None, fill: bool = True) -> torch.nn.Module:
    """This rank's tensor-parallel copy of ``model`` over ``group``: same signature, full outputs on every rank
    (``autotp.parallelize`` without a mesh).

    Rank 0 solves and shares the plan, so every rank runs the same program; ranks first check that
    they hold the same model and input shapes, and a rank that fails or dies makes the others raise
    within ``timeout`` seconds.  A model on the meta device keeps this rank's pieces on meta, at their local
    shapes, unless ``checkpoint=DIR`` (safetensors, Hugging Face layout) gives them values, each rank reading
    only its own slices, or ``init_seed`` fills them with the model's own initialisation (the same full model on
    any layout; runtime/materialize.py); ``autotp.materialize`` fills them later.  ``verify=True`` runs the
    example inputs through both models and names the first diverging op (needs the model's weights).
    ``gather_outputs=False`` leaves outputs sharded where the plan computes them sharded (vocab-parallel
    logits for ``autotp.parallel_cross_entropy``); partial sums are still reduced.  ``fixed``: parameter
    name -> placement to impose (another program's layout, to share its shards).  ``check_inputs``:
    ranks compare a digest of the input values on the ``"first"`` call, on ``"always"``, or never (``False``), and
    so for a model captured in training mode that drops, their random generators' states on the first call that
    drops.  ``dropout``: how the masks are drawn, "default" (Megatron's model-parallel streams) or "reference"
    (each rank its piece of the masks one process draws for the same seed; for tests; docs/dropout.md).
    ``expert_groups``: (a mesh's "ep" group, the group of its "ep" x "tp" ranks), which ``parallelize`` passes
    for a mesh with an "ep" dimension: expert segments are dispatched over them (runtime/expert_dispatch.py).
    ``graph``: a captured part of ``model`` to shard instead of the whole (a pipeline stage, parallel/split.py).
    ``fill=False`` leaves the checkpoint's and ``init_seed``'s tensors on meta, for the caller to fill once FSDP2
    has split them (parallel/mesh.py).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("autotp.parallelize needs torch.distributed: call dist.init_process_group(...) first "
                           "(launch with torchrun), or use autotp.plan(...) to inspect a plan without one")
    if check_inputs not in ("first", "always", False):
        raise ValueError(f'check_inputs must be "first", "always" or False, got {check_inputs!r}')
    if verify and graph is not None:
        raise ValueError("verify=True compares a whole model with its sharded program: verify without pipeline "
                         "stages (a mesh without 'pp')")
    group = group or dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ep_group, routed_group = expert_groups or (None, group)
    options = Options(topology=topology, min_shard_fraction=min_shard_fraction, training=training,
                      memory_limit=memory_limit, gather_outputs=gather_outputs, fixed=fixed,
                      sequence_parallel=sequence_parallel, recompute=recompute, experts=experts, dropout=dropout,
                      ep=dist.get_world_size(ep_group) if ep_group is not None else 1)
    rendezvous = Rendezvous(group, timeout)
    planners = Rendezvous(routed_group, timeout) if ep_group is not None else rendezvous  # one plan for "ep" too
    if args is None and kwargs is None:
        args = default_inputs(model)
    gm = prepare(graph) if graph is not None else prepared_graph(model, args, kwargs)
    graph_hash = fingerprint(gm)
    planners.agree("model", f"{graph_hash}/{inputs_digest(args, kwargs)}", "the model and input shapes")
    if plan is None:
        text = planners.share("plan", lambda: solve_plan(gm, world, options, price_experts=True).to_json())
        plan = Plan.from_json(text, validate=False)
    else:
        text = plan.to_json()
    planners.agree("plan", hashlib.sha256(text.encode()).hexdigest()[:16], "the plan")
    if plan.mesh.get("ep", 1) != options.ep:
        raise PlanMismatch(f"the plan dispatches experts over {plan.mesh.get('ep', 1)} \"ep\" ranks, the mesh has "
                           f"{options.ep}: re-plan for this mesh")
    flagged: set = set()
    choice = plan_choice(gm, plan, graph_hash, world, flagged)
    again = [core for core in attention_cores(gm, needs_grad(gm)) if core[-1] in flagged]
    source = checkpoint_source(checkpoint, model)
    if source is not None:
        check_tensors(source, gm, _names(model) if graph is not None else frozenset())
    device = device_of(group)
    retarget_device(gm, device)  # a capture on meta names it in factory calls: the program runs on the device
    groups = Groups(_group(routed_group), _group(ep_group) if ep_group is not None else None)
    sharded = rewrite(gm, choice, rank, world, group.group_name, frozenset(source.files) if source else frozenset(),
                      device, gather_outputs, groups)
    checkpoint_cores(sharded, again)
    dropouts = set_mode(sharded, options.dropout)
    for member in {group, routed_group, ep_group} - {None}:
        register(member)
    sharded.autotp_plan = plan
    sharded.autotp_group = group
    sharded.autotp_experts = groups
    sharded.autotp_config = getattr(model, "config", None)
    object.__setattr__(sharded, "autotp_source", model)  # for autotp.generate; not a submodule
    if fill and (source is not None or init_seed is not None):
        materialize(sharded, device, checkpoint=source, seed=init_seed)
    planners.agree("loaded", "ok", "the end of loading")
    if check_inputs:
        InputCheck(rendezvous, every_call=check_inputs == "always").attach(sharded)
        if dropouts:
            RandomCheck(rendezvous, check_inputs == "always", dropouts, device).attach(sharded)
    if verify:
        if any(p.is_meta for p in model.parameters()):
            raise ValueError("verify=True compares with the unsharded model, whose weights are on the meta device: "
                             "verify with a model that fits in memory, or drop verify")
        from autotp.passes.verify import verify as check
        check(sharded, prepared_graph(model, args, kwargs), args, kwargs)
    return sharded


def checkpoint_source(checkpoint, model: torch.nn.Module):
    """``checkpoint=`` as a source of pieces: a safetensors directory read through ``model``'s stored layout, a
    torch.distributed.checkpoint directory, or an object that reads pieces itself (generation's resident shards)."""
    if checkpoint is None or hasattr(checkpoint, "read_box") or hasattr(checkpoint, "load"):
        return checkpoint
    if (Path(checkpoint) / ".metadata").exists():
        return DcpDirectory(checkpoint, _names(model))
    return Checkpoint(checkpoint, model_conversions(model))


def _names(model: torch.nn.Module) -> frozenset:
    """Every name of ``model``'s parameters and buffers, tied ones under each name."""
    return frozenset(name for name, _ in [*model.named_parameters(remove_duplicate=False),
                                          *model.named_buffers(remove_duplicate=False)])


def from_pretrained(directory, *, dtype: torch.dtype | None = None, **options) -> torch.nn.Module:
    """A Hugging Face causal LM directory, sharded: built on the meta device, each rank reading only
    its own slices of the safetensors files.  ``options`` go to ``parallelize``."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(directory)
    with init_empty_weights(include_buffers=False):  # computed buffers (rotary tables) stay real
        model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    model.tie_weights()  # transformers ties input/output embeddings only when asked, on empty weights
    return tensor_parallel(model.eval(), checkpoint=directory, **options)


def plan_choice(gm: torch.fx.GraphModule, plan: Plan, graph_hash: str, world: int,
                recomputed: set | None = None) -> dict:
    """node -> Strategy from the plan; a folded plan's block-1 decisions stamped on every middle block.
    ``recomputed`` (filled in): the nodes the plan recomputes in the backward."""
    names = {node: node.name for node in gm.graph.nodes}
    if plan.fold:
        repeats = Fold(**plan.fold)
        try:
            folding = fold_graph(gm, repeats)
        except NotFoldable as exc:
            raise PlanMismatch(f"the plan folds {repeats.count} blocks of {repeats.path}, but in this model's graph "
                               f"{exc}: re-plan with fold=False") from None
        graph_hash = folding.fingerprint(gm)
        by_key = {entry.get("key"): name for name, entry in plan.nodes.items()}
        names = {node: by_key.get(folding.blocks.key[node]) for node in gm.graph.nodes}
    plan.check(graph_hash, world)
    choice = {}
    for node, name in names.items():
        if name in plan.nodes:
            inputs, output = plan.strategy(name)
            choice[node] = Strategy(tuple(inputs), output)
            if recomputed is not None and plan.nodes[name].get("recompute"):
                recomputed.add(node)
    return choice


def _group(group) -> Group:
    return Group(group.group_name, dist.get_rank(group), dist.get_world_size(group))
