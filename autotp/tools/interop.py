"""Plans in other systems' words: DTensor ``parallelize_module`` styles and HF ``tp_plan`` strings,
and Hugging Face's own per-architecture plans as parameter placements (for ``autotp compare``)."""

from __future__ import annotations

import functools
import re

from autotp.passes.fold import Fold
from autotp.placement import R, Replicate, Shard, parse
from autotp.plan import Plan

_LINEAR = "aten.linear.default"
_EMBEDDING = "aten.embedding.default"


def _matmul_nodes(plan: Plan) -> dict:
    """module path -> (node name, entry) of the single linear/embedding op that uses its weight."""
    found: dict = {}
    for name, entry in plan.nodes.items():
        if entry.get("op") in (_LINEAR, _EMBEDDING) and entry.get("module"):
            found.setdefault(entry["module"], []).append((name, entry))
    return {module: nodes[0] for module, nodes in found.items() if len(nodes) == 1}


def _gathered(plan: Plan, module: str) -> bool:
    return any(c["phase"] == "forward" and c["op"] == "all_gather" and c["module"] == module for c in plan.collectives)


def _styles(plan: Plan) -> tuple[dict, dict]:
    """module -> (kind, input replicated?, output replicated?) and module -> why not expressible."""
    styles, unsupported = {}, {}
    for module, (_, entry) in _matmul_nodes(plan).items():
        weight = plan.params.get(f"{module}.weight")
        if weight is None:
            continue
        placement = parse(weight)
        if isinstance(placement, Replicate):
            continue
        if placement.chunks:
            unsupported[module] = f"fused weight split block by block ({weight}): no DTensor placement interleaves"
            continue
        if placement.units is not None:
            unsupported[module] = (
                f"whole heads dealt unevenly or shared by ranks ({weight}): DTensor's Shard "
                "and HF's tp_plan split evenly"
            )
            continue
        if entry["op"] == _EMBEDDING:
            if placement.dim == 1:
                styles[module] = ("column", False, True)
            else:
                unsupported[module] = "vocabulary-split embedding"
            continue
        if placement.dim == 0:
            styles[module] = ("column", False, _gathered(plan, module))
        else:
            styles[module] = ("row", not _arrives_sharded(plan, entry), True)
    if plan.fold:  # block 1 stands for the middle blocks
        fold = Fold(**plan.fold)
        return fold.expand(styles), fold.expand(unsupported)
    return styles, unsupported


def _arrives_sharded(plan: Plan, entry: dict) -> bool:
    """Outside autotp's rewriter, an activation is a local shard only downstream of a column-parallel
    module whose output is not gathered: walk back through sharded ops to the producing matmul."""
    name = entry.get("args", [None])[0]
    seen = set()
    while name in plan.nodes and name not in seen:
        seen.add(name)
        producer = plan.nodes[name]
        if producer.get("op") in (_LINEAR, _EMBEDDING):
            weight = plan.params.get(f"{producer.get('module')}.weight")
            column = weight is not None and isinstance(parse(weight), Shard) and parse(weight).dim == 0
            return column and not _gathered(plan, producer["module"])
        if not isinstance(parse(producer["out"]), Shard):
            return False
        name = (producer.get("args") or [None])[0]
    return False


def to_dtensor_plan(plan: Plan) -> tuple[dict, dict]:
    """({module path: ParallelStyle}, {module path: why it cannot be expressed}).

    Use the first with ``torch.distributed.tensor.parallel.parallelize_module(model, mesh, styles)``
    where the second is empty; modules listed there need autotp's own rewriter.
    """
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out = {}
    styles, unsupported = _styles(plan)
    for module, (kind, replicated_in, replicated_out) in styles.items():
        if kind == "column":
            out[module] = ColwiseParallel(output_layouts=DReplicate()) if replicated_out else ColwiseParallel()
        else:
            out[module] = RowwiseParallel(input_layouts=DReplicate()) if replicated_in else RowwiseParallel()
    return out, unsupported


def to_hf_tp_plan(plan: Plan) -> tuple[dict, dict]:
    """({module pattern: HF style}, unsupported), layer indices folded into ``*`` where layers agree."""
    styles, unsupported = _styles(plan)
    words = {}
    for module, (kind, replicated_in, replicated_out) in styles.items():
        if kind == "column":
            words[module] = "colwise_gather_output" if replicated_out else "colwise"
        else:
            words[module] = "rowwise_split_input" if replicated_in else "rowwise"
    folded: dict = {}
    for module, word in words.items():
        folded.setdefault(re.sub(r"\.\d+\.", ".*.", module), set()).add(word)
    out = {}
    for pattern, found in folded.items():
        if len(found) == 1:
            out[pattern] = found.pop()
        else:  # layers disagree: keep them apart
            out.update({m: w for m, w in words.items() if re.sub(r"\.\d+\.", ".*.", m) == pattern})
    return out, unsupported


# HF styles -> the dim of the weight they split, counted from the end as transformers counts it (a 3-D expert
# tensor [E, out, in] splits like its 2-D matrices); "packed": gate|up split block by block; experts: dim 0
_HF_WEIGHT = {
    "colwise": -2,
    "colwise_gather_output": -2,
    "local_colwise": -2,
    "packed_colwise": -2,
    "rowwise": -1,
    "rowwise_split_input": -1,
    "local_rowwise": -1,
    "grouped_gemm": 0,
    "colwise_rep": -2,
    "rowwise_rep": -1,
    "embedding_rowwise": -2,
    "embedding_colwise": -1,
}  # an embedding table is [vocab, hidden]


def _hf_shard(style: str, shape) -> Shard:
    dim = _HF_WEIGHT[style] % len(shape)
    return Shard(dim, (shape[dim] // 2,) * 2) if style == "packed_colwise" else Shard(dim)


def hf_styles(model, expert_parallel: bool = False) -> dict:
    """Hugging Face's hand-written plan for this architecture: module pattern -> style (its tp_plan, and with
    ``expert_parallel`` its ep_plan over it), patterns from the model's root."""
    if getattr(model, "tp_plan", None):  # the instance's whole plan (transformers 5: the embedding's too)
        return {**model.tp_plan, **((getattr(model, "ep_plan", None) or {}) if expert_parallel else {})}
    config = getattr(model, "config", None)
    rules = {}
    prefix = getattr(model, "base_model_prefix", "")
    plans = [getattr(config, "base_model_tp_plan", None)]
    plans += [getattr(config, "base_model_ep_plan", None)] if expert_parallel else []
    for plan in plans:
        for pattern, style in (plan or {}).items():
            rules[f"{prefix}.{pattern}" if prefix else pattern] = style
    rules.update(getattr(type(model), "_tp_plan", None) or {})
    return rules


def hf_parameter_placements(model, expert_parallel: bool = False) -> dict:
    """Hugging Face's hand-written plan for this architecture, as parameter placements."""
    return style_placements(model, hf_styles(model, expert_parallel))


@functools.cache
def pattern_regex(pattern: str) -> re.Pattern:
    """A plan's module pattern as a regex: ``*`` stands for a layer index (HF's tp_plan convention)."""
    return re.compile(pattern.replace(".", r"\.").replace("*", r"\d+"))


def style_placements(model, rules: dict) -> dict:
    """Parameter name -> placement for the parameters a plan of HF-style strings (module pattern -> style, ``*``
    a layer index) splits; the rest are left out (replicated)."""
    placements = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        module, _, attr = name.rpartition(".")
        for pattern, style in rules.items():
            regex = pattern_regex(pattern)
            if style not in _HF_WEIGHT:
                continue
            if regex.fullmatch(name):  # a parameter the plan names (3-D experts)
                placements[name] = _hf_shard(style, param.shape)
                break
            if regex.fullmatch(module):
                weight = _hf_shard(style, param.shape) if attr == "weight" else None
                placements[name] = weight or (Shard(0) if _HF_WEIGHT[style] == -2 else R)
                break
    return placements
