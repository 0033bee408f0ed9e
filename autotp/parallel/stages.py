"""Where pipeline stages begin: between the blocks of the model's repeated block list, balancing estimated stage
time under the memory limit.

The blocks are found from the module tree (the longest ``nn.ModuleList`` of identical blocks, passes/fold.py),
never by name.  Each block is priced on autotp's captured graph with the cost model: roofline time of its ops
(forward and backward) and what it holds (parameters with gradients and Adam state, activations kept for
backward), taken as split evenly over the TP group; what runs before the first block (the embedding) counts on
the first stage, what runs after the last (norm, head, loss) on the last.  The split itself is the mesh
planner's: ``cost_models.mesh_layout.stage_ranges`` with each stage's memory as ``autotp.plan_mesh`` prices it.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from autotp.cost_models import load_topology
from autotp.cost_models.mesh_layout import Candidate, Profile, Section, Setting, held_by, stage_memory, stage_ranges
from autotp.cost_models.pricing import activation_bytes, op_memory, op_seconds, priced_unit, read_at_both_ends
from autotp.ops.strategies import Strategy, input_slots, needs_grad, replicated_like
from autotp.passes.fold import Fold, find_fold, sections


class StageError(ValueError):
    pass


def find_blocks(model: torch.nn.Module) -> Fold:
    """The model's repeated block list (at least two identical blocks), or a StageError saying what is needed."""
    found = find_fold(model, min_blocks=2)
    if found is None:
        raise StageError(
            f"{type(model).__name__} has no list of identical blocks (an nn.ModuleList of modules with "
            "equal classes and shapes): pipeline stages are cut between such blocks"
        )
    return found


def block_profile(gm: torch.fx.GraphModule, fold: Fold, tp: int = 1, topology=None) -> Profile:
    """Each block of ``gm`` (a graph captured whole, or folded: ``gm.meta["autotp_fold"]``, whose block 1 stands
    for the middle blocks) and the parts before and after them, per sample on one of ``tp`` ranks, for training."""
    topo = load_topology(topology)
    where, _, _ = sections(gm, fold)
    rep = fold.rep if gm.meta.get("autotp_fold") else (lambda i: i)
    unit, sizes = priced_unit(gm)
    trainable = dict(gm.named_parameters(remove_duplicate=False))
    replicated = {
        node: Strategy(tuple(map(replicated_like, input_slots(node))), replicated_like(node))
        for node in gm.graph.nodes
        if node.op in ("call_function", "get_attr")
    }
    kept, tied, both = {}, {}, read_at_both_ends(where)
    for node, strategy in replicated.items():  # priced on one rank, then taken as split evenly over tp
        section = kept.setdefault(where.get(node, "pre"), Section())
        section.seconds += op_seconds(node, strategy, sizes, 1, topo, True) / unit / tp
        for kind, held in op_memory(node, strategy, sizes, 1, trainable, True).items():
            per_sample = kind in ("activations", "kv_cache")
            section.memory[kind] = section.memory.get(kind, 0.0) + held / tp / (unit if per_sample else 1)
            if node in both:
                tied[kind] = tied.get(kind, 0.0) + held / tp
    for node, held in activation_bytes(
        {n: s for n, s in replicated.items() if n.op == "call_function"}, sizes, 1, needs_grad(gm)
    ).items():  # what backward keeps
        section = kept.setdefault(where.get(node, "pre"), Section())
        section.memory["activations"] = section.memory.get("activations", 0.0) + held / tp / unit
    order = ["pre", *(rep(i) for i in range(fold.count)), "post"]
    return Profile(tp, [kept.get(key, Section()) for key in order], boundary=0.0, stackable=True, tied=tied)


def stage_starts(profile: Profile, layout: Candidate, setting: Setting) -> list:
    """The block where each (virtual) stage of ``layout`` begins: the slowest stage as fast as each stage's
    memory under ``setting.limit`` allows, or a StageError saying what would fit."""
    stages, blocks = layout.pp * layout.virtual_stages, len(profile.blocks)
    if not 1 <= stages <= blocks:
        raise StageError(f"{stages} pipeline stages need at least {stages} blocks; the model has {blocks}")
    ranges = stage_ranges(profile, layout, setting)
    if ranges is None:
        balanced = stage_ranges(profile, layout, replace(setting, limit=math.inf))
        m = setting.global_batch // layout.dp // layout.microbatch_size
        need = max(
            stage_memory(profile, [balanced[s] for s in held_by(layout, i)], i, layout, m, setting.data_parallel)[
                0
            ].total
            for i in range(layout.pp)
        )
        raise StageError(
            f"no split of the {blocks} blocks into {stages} stages fits {setting.limit / 1e9:.3g} GB per "
            f"device (the time-balanced one needs {need / 1e9:.3g} GB): use more pipeline stages or TP "
            "ranks, FSDP (data_parallel='fsdp') over more replicas, smaller micro-batches (more of "
            "them), or a larger memory_limit"
        )
    return [start for start, _ in ranges]
