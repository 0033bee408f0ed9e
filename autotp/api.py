"""The pipeline in one place: capture -> rules -> cost -> solve -> rewrite -> load."""
from __future__ import annotations

import hashlib
import warnings

import torch
import torch.distributed as dist

from autotp.cost_models import load_topology
from autotp.passes.accounting import alternatives, planned_collectives
from autotp.passes.capture import CaptureError, capture, fingerprint, module_path
from autotp.passes.capture import check_inputs as check_example_inputs
from autotp.passes.fold import Fold, NotFoldable, find_fold, fold_graph, folded
from autotp.passes.group_cuts import cuts_to_gathers
from autotp.passes.ops import TABLE
from autotp.passes.prepare import (
    add_hints,
    drop_no_ops,
    fuse_repeat_kv,
    merge_aliases,
    retarget_device,
    split_bias,
    unflatten_products,
)
from autotp.passes.pricing import Sizes, activation_bytes
from autotp.passes.recompute import attention_cores, checkpoint_cores
from autotp.passes.rewrite import rewrite
from autotp.passes.solve import DoesNotFit, PlanningError, solve
from autotp.passes.strategies import Context, Strategy, enumerate_strategies, input_slots, needs_grad, on_tokens
from autotp.passes.styles import param_styles

from .agree import DEFAULT_TIMEOUT, InputCheck, Rendezvous, inputs_digest
from .hf import default_inputs, fill_computed_buffers, no_kv_cache
from .options import Options
from .plan import Plan, PlanMismatch
from .runtime.collectives import register
from .runtime.conversion import model_conversions
from .runtime.hf_checkpoint import Checkpoint
from .runtime.placement import Disjoint, Shard


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
        gm = capture(model, args if args is not None else (), kwargs)
    merge_aliases(gm)
    split_bias(gm)
    unflatten_products(gm)
    fuse_repeat_kv(gm)
    drop_no_ops(gm)
    cuts_to_gathers(gm)
    return gm


def solve_plan(gm: torch.fx.GraphModule, world_size: int, options: Options | None = None, *,
               sizes: Sizes | None = None, price_experts: bool = False) -> Plan:
    """The plan for ``world_size`` ranks.  Sequence parallelism and recomputation are tried in Korthikanti et
    al.'s order when ``options`` leave them open (None) and the plain plan does not fit; ``price_experts``: also
    price the best plan with each expert split imposed (``plan.cost["experts"]``, for reports)."""
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
    ctx = _strategies(gm, world_size, options, tokens, options.experts)
    folding = gm.meta.get("autotp_fold")
    if folding and any(ctx.strategies.get(a) != ctx.strategies.get(b) for a, b in folding.ties):
        raise PlanningError(f"the blocks of {folding.fold.path} look identical but offer different shardings: "
                            "plan with fold=False")
    if ctx.unruled:
        warnings.warn(f"autotp: {len(ctx.unruled)} op(s) on the weights' path have no sharding rule and run "
                      f"replicated (correct, possibly slower): {', '.join(sorted(ctx.unruled))}", stacklevel=4)
    weights = folding.weights if folding else None
    training = options.training

    def run(ctx: Context):
        return solve(gm, ctx, topo, training=training, memory_limit=options.memory_limit, sizes=sizes,
                     gather_outputs=options.gather_outputs, weights=weights, ties=folding.ties if folding else (),
                     sequence_parallel=bool(options.sequence_parallel), recompute=recompute)
    solution = run(ctx)
    choice = solution.choice
    offered = any(isinstance(s.output, Disjoint) for options_ in ctx.strategies.values() for s in options_)
    experts_cost = None if not (offered and price_experts) or options.fixed or options.experts else _expert_costs(
        choice, lambda mode: run(_strategies(gm, world_size, options, tokens, mode)).seconds)
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
        cost={"seconds": solution.seconds, "memory": solution.memory, "training": training,
              "regathers": [{"tensor": n.name, **priced} for n, priced in solution.regathers.items()],
              **_activations_by_module(gm, choice, sizes, world_size, training, solution.recomputed),
              **({"experts": experts_cost} if experts_cost else {})},
        replicated_ops=sorted(ctx.unruled),
        fold=({"path": folding.fold.path, "count": folding.fold.count,
               **({"start": folding.fold.start} if folding.fold.start else {})} if folding else None),
    )


def _strategies(gm: torch.fx.GraphModule, world_size: int, options: Options, tokens: bool,
                experts: str | None) -> Context:
    ctx = Context(world=world_size, min_shard_fraction=options.min_shard_fraction, fixed=options.fixed or {},
                  tokens=tokens, experts=experts, ops=TABLE)
    add_hints(gm, ctx)
    enumerate_strategies(gm, ctx)
    return ctx


def _expert_costs(choice: dict, step_seconds) -> dict:
    """How the plan holds its experts (3-D parameters): whole experts per rank ("parallel"), each expert
    split ("tensor"), both ("mixed") or neither ("replicated"); and the estimated step time of the best
    plan with each imposed (None where none fits), for reports: the solver chose among all at once."""
    kinds = {"parallel" if s.output.dim == 0 else "tensor" for n, s in choice.items()
             if n.op == "get_attr" and n.meta["val"].dim() == 3 and isinstance(s.output, Shard)}
    seconds = {}
    for mode in ("tensor", "parallel"):
        try:
            seconds[mode] = step_seconds(mode)
        except PlanningError:
            seconds[mode] = None
    return {"chosen": kinds.pop() if len(kinds) == 1 else "mixed" if kinds else "replicated", "seconds": seconds}


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
            "recompute": sorted({module_path(core[-1]) for core in recomputed})}


def plan(model: torch.nn.Module, args=None, kwargs=None, *, world_size: int, topology=None,
         min_shard_fraction: float = 0.02, training: bool = True, memory_limit: float | None = None,
         fold: bool = True, sequence_parallel: bool | None = None, recompute: str | bool | None = None,
         experts: str | None = None) -> Plan:
    """Find a sharding plan without any process group (the model may be on the meta device).

    Costs are estimated at the example inputs' sizes: pass realistic ones (on the meta device
    they cost nothing).  ``memory_limit``: bytes per device (default 90% of the topology's).
    ``fold``: plan a long stack of identical blocks from four of them (same plan, time independent of
    depth; see passes/fold.py); ``fold=False`` captures and solves every block.  ``sequence_parallel``:
    split the norms, dropouts and residual adds by tokens (Megatron's sequence parallelism): True,
    False, or None to take it only when memory demands it.  ``recompute``: recompute the attention cores
    in the backward instead of keeping their scores (Megatron's selective recomputation): "selective",
    False, or None to take it where memory demands it (after sequence parallelism).  ``experts``: how
    mixture-of-experts layers are split: "parallel" (whole experts per rank), "tensor" (every expert split
    Megatron-style), or None to let the cost model choose (``plan.experts`` prices both).
    """
    options = Options(topology=topology, min_shard_fraction=min_shard_fraction, training=training,
                      memory_limit=memory_limit, sequence_parallel=sequence_parallel, recompute=recompute,
                      experts=experts)
    return solve_plan(prepared_graph(model, args, kwargs, fold), world_size, options, price_experts=True)


def tensor_parallel(model: torch.nn.Module, args=None, kwargs=None, *, plan: Plan | None = None, topology=None,
                    group=None, checkpoint=None, min_shard_fraction: float = 0.02, training: bool = True,
                    memory_limit: float | None = None, timeout: float = DEFAULT_TIMEOUT, gather_outputs: bool = True,
                    fixed: dict | None = None, check_inputs: str | bool = "first",
                    verify: bool = False, sequence_parallel: bool | None = None,
                    recompute: str | bool | None = None, experts: str | None = None) -> torch.nn.Module:
    """This rank's tensor-parallel copy of ``model`` over ``group``: same signature, full outputs on every rank
    (``autotp.parallelize`` without a mesh).

    Rank 0 solves and shares the plan, so every rank runs the same program; ranks first check that
    they hold the same model and input shapes, and a rank that fails or dies makes the others raise
    within ``timeout`` seconds.  With ``checkpoint=DIR`` (safetensors, Hugging Face layout) the model
    may live on the meta device and each rank reads only its own slices.  ``verify=True`` runs the
    example inputs through both models and names the first diverging op (needs the model's weights).
    ``gather_outputs=False`` leaves outputs sharded where the plan computes them sharded (vocab-parallel
    logits for ``autotp.parallel_cross_entropy``); partial sums are still reduced.  ``fixed``: parameter
    name -> placement to impose (another program's layout, to share its shards).  ``check_inputs``:
    ranks compare a digest of the input values on the ``"first"`` call, on ``"always"``, or never (``False``).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("autotp.parallelize needs torch.distributed: call dist.init_process_group(...) first "
                           "(launch with torchrun), or use autotp.plan(...) to inspect a plan without one")
    if check_inputs not in ("first", "always", False):
        raise ValueError(f'check_inputs must be "first", "always" or False, got {check_inputs!r}')
    options = Options(topology=topology, min_shard_fraction=min_shard_fraction, training=training,
                      memory_limit=memory_limit, gather_outputs=gather_outputs, fixed=fixed,
                      sequence_parallel=sequence_parallel, recompute=recompute, experts=experts)
    group = group or dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rendezvous = Rendezvous(group, timeout)
    if args is None and kwargs is None:
        args = default_inputs(model)
    gm = prepared_graph(model, args, kwargs)
    graph_hash = fingerprint(gm)
    rendezvous.agree("model", f"{graph_hash}/{inputs_digest(args, kwargs)}", "the model and input shapes")
    if plan is None:
        plan = Plan.from_json(rendezvous.share("plan", lambda: solve_plan(gm, world, options).to_json()))
    rendezvous.agree("plan", hashlib.sha256(plan.to_json().encode()).hexdigest()[:16], "the plan")
    flagged: set = set()
    choice = plan_choice(gm, plan, graph_hash, world, flagged)
    again = [core for core in attention_cores(gm, needs_grad(gm)) if core[-1] in flagged]
    source = checkpoint if checkpoint is None or hasattr(checkpoint, "read") else Checkpoint(
        checkpoint, model_conversions(model))
    device = device_of(group)
    if source is not None:
        retarget_device(gm, device)
        fill_computed_buffers(gm, model, device, source.files)
    sharded = rewrite(gm, choice, rank, world, group.group_name, source, device, gather_outputs)
    checkpoint_cores(sharded, again)
    register(group)
    rendezvous.agree("loaded", "ok", "the end of loading")
    if check_inputs:
        InputCheck(rendezvous, every_call=check_inputs == "always").attach(sharded)
    sharded.autotp_plan = plan
    sharded.autotp_group = group
    sharded.autotp_config = getattr(model, "config", None)
    object.__setattr__(sharded, "autotp_source", model)  # for autotp.generate; not a submodule
    if verify:
        if any(p.is_meta for p in model.parameters()):
            raise ValueError("verify=True compares with the unsharded model, whose weights are on the meta device: "
                             "verify with a model that fits in memory, or drop verify")
        from .verify import verify as check
        check(sharded, prepared_graph(model, args, kwargs), args, kwargs)
    return sharded


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


def device_of(group) -> torch.device:
    """Where this rank's shards live: its GPU under NCCL, the CPU otherwise."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
