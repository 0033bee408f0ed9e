"""Plans for serving: one set of weights for a decode step with its KV cache at a context length and for the
prefill, priced with the figures a deployment is sized by (vLLM's ``--max-model-len``,
``--gpu-memory-utilization``): decode time per step and tokens/s at a batch, prefill time per 1,000 tokens, and
how many sequences of that context fit beside the weights.

Memory is the pool's, as an engine holds it: the weights, the KV cache (K and V by KV heads, every layer's: the
decode program's cache buffers) and the temporaries at their peak (the largest one op holds while it runs, e.g.
grouped-query attention's repeated K and V, of the decode step or of one prefill chunk of
``max_num_batched_tokens``), not summed over layers (cost_models/kv_memory.py).  Where ``max_batch`` sequences do
not fit, the plan is made for the number that does (``requested`` keeps what was asked); none fitting is
``DoesNotFit``.

The decode program is the one ``autotp.generate`` runs (serving/generation.py: the model around a static KV
cache written in place), captured on the meta device and planned for a one-token step of ``max_batch``
sequences whose attention reads the whole cache; the cache is a tensor like any other, so it is split by KV heads
where the plan splits the heads.  The prefill is the plain forward priced at ``prefill_tokens`` tokens with the
decode plan's parameter placements imposed.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from autotp.cost_models import load_topology
from autotp.cost_models.memory import PEAK_KINDS
from autotp.options import PlanOptions
from autotp.passes.prepared_graph import prepared_graph
from autotp.plan import Plan
from autotp.planning.solution import DoesNotFit
from autotp.planning.tensor_plan import solve_plan

PREFIX = "model."  # the decode wrapper holds the model as ``model``


@dataclass(frozen=True)
class ServePlan:
    decode: Plan  # a one-token step of ``batch`` sequences, the cache at ``context``
    prefill: Plan  # one chunk of ``prefill_tokens`` tokens, the decode plan's weights
    world_size: int
    context: int
    batch: int  # sequences planned: ``requested``, or as many as fit
    prefill_tokens: int
    memory_fraction: float
    device_bytes: float
    bandwidth_bound_seconds: float  # the weights and the cache read once at the device's memory bandwidth
    requested: int  # sequences asked for (--max-batch)

    @property
    def decode_seconds(self) -> float:
        return self.decode.cost["seconds"]

    @property
    def tokens_per_second(self) -> float:
        return self.batch / self.decode_seconds

    @property
    def prefill_seconds_per_1000(self) -> float:
        return self.prefill.cost["seconds"] * 1000 / self.prefill_tokens

    @property
    def cache_bytes(self) -> float:
        """This rank's KV cache for ``batch`` sequences: the decode program's buffers beyond the forward's own
        (rotary tables and the like)."""
        return self.decode.cost["memory"].get("buffers", 0.0) - self.prefill.cost["memory"].get("buffers", 0.0)

    @property
    def kv_bytes_per_sequence(self) -> float:
        return self.cache_bytes / self.batch

    @property
    def sequences_that_fit(self) -> int:
        """Sequences of ``context`` tokens whose cache (and their share of the decode step's temporaries) fits
        beside the weights in ``memory_fraction`` of a device."""
        return _fitting(self.decode, self.prefill, self.batch, self.memory_fraction * self.device_bytes)

    def summary(self) -> dict:
        return {
            "world_size": self.world_size,
            "context": self.context,
            "batch": self.batch,
            "requested_batch": self.requested,
            "decode_ms": self.decode_seconds * 1e3,
            "tokens_per_second": self.tokens_per_second,
            "prefill_ms_per_1000_tokens": self.prefill_seconds_per_1000 * 1e3,
            "bandwidth_bound_ms": self.bandwidth_bound_seconds * 1e3,
            "kv_cache_gb_per_sequence": self.kv_bytes_per_sequence / 1e9,
            "sequences_that_fit": self.sequences_that_fit,
            "decode_forward": dict(self.decode.collective_counts("forward")),
        }


def plan_serving(
    model: torch.nn.Module,
    *,
    world_size: int,
    context: int,
    max_batch: int,
    topology=None,
    memory_fraction: float = 0.9,
    prefill_tokens: int = 512,
) -> ServePlan:
    """The serving plan of a causal LM (a transformers model; built on meta, nothing is read) on ``world_size``
    ranks, for ``max_batch`` sequences or as many as fit; ``prefill_tokens``: the prefill's chunk (the server's
    --max-num-batched-tokens)."""
    for name, value in (("context", context), ("max_batch", max_batch), ("prefill_tokens", prefill_tokens)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
    topo = load_topology(topology)
    pool = memory_fraction * topo.memory_bytes
    decode, prefill = _plans(model, world_size, context, max_batch, prefill_tokens, topo)
    batch = min(max_batch, _fitting(decode, prefill, max_batch, pool))
    if batch < 1:
        raise DoesNotFit(
            f"not one sequence of {context} tokens fits at TP {world_size}: the weights take "
            f"{decode.cost['memory']['params'] / 1e9:.1f} GB of the {pool / 1e9:.1f} GB a device gives "
            f"({memory_fraction:.0%}); serve at a larger --world-size, a shorter --context, or on larger devices"
        )
    if batch < max_batch:  # the step of the sequences that fit: its cache and temporaries at that batch
        decode, prefill = _plans(model, world_size, context, batch, prefill_tokens, topo)
    memory = decode.cost["memory"]
    read = memory["params"] + memory.get("buffers", 0.0)  # every weight and the whole cache, once a step
    return ServePlan(
        decode,
        prefill,
        world_size,
        context,
        batch,
        prefill_tokens,
        memory_fraction,
        topo.memory_bytes,
        read / topo.hbm_bandwidth,
        max_batch,
    )


def _plans(model: torch.nn.Module, world_size: int, context: int, batch: int, chunk: int, topo) -> tuple:
    """(the decode step's plan at ``batch`` sequences, one prefill chunk's with its weights), memory unlimited:
    what fits is counted from their terms (``_fitting``)."""
    unlimited = float("inf")
    _, gm, step = decode_program(model, context, batch)
    decode = solve_plan(
        gm,
        world_size,
        PlanOptions(topology=topo, training=False, price_at=step, memory_limit=unlimited),
        price_experts=True,
    )
    weights = {name[len(PREFIX) :]: placement for name, placement in decode.params.items() if name.startswith(PREFIX)}
    ids = torch.zeros(2, 16, dtype=torch.long, device=torch.device("meta"))
    forward = prepared_graph(model, (ids,), None, fold=True)
    names = {n.target for n in forward.graph.nodes if n.op == "get_attr"}
    prefill = solve_plan(
        forward,
        world_size,
        PlanOptions(
            topology=topo,
            training=False,
            fixed={k: v for k, v in weights.items() if k in names},
            price_at={"input_ids": (1, chunk)},
            memory_limit=unlimited,
        ),
    )
    return decode, prefill


def _peak(plan: Plan) -> float:
    return sum(plan.cost["memory"].get(kind, 0.0) for kind in PEAK_KINDS)


def _fitting(decode: Plan, prefill: Plan, batch: int, pool: float) -> int:
    """Sequences whose cache and share of the decode step's temporaries (both grow with the batch) fit in
    ``pool`` beside the weights, the other buffers and a prefill chunk's temporaries."""
    memory = decode.cost["memory"]
    others = prefill.cost["memory"].get("buffers", 0.0)
    per_sequence = (memory.get("buffers", 0.0) - others + _peak(decode)) / batch
    free = pool - memory["params"] - others - _peak(prefill)
    return max(0, int(free // per_sequence)) if per_sequence > 0 else 0


def decode_program(model: torch.nn.Module, context: int, batch: int) -> tuple:
    """(the decode wrapper, its captured graph, the price_at of a one-token step of ``batch`` sequences)."""
    from autotp.serving.generation import _CachedLM

    meta = torch.device("meta")
    model.eval()
    wrapper = _CachedLM(model, batch, context, meta).eval()
    example = (
        torch.zeros(batch, 2, dtype=torch.long, device=meta),
        torch.ones(batch, context, dtype=torch.long, device=meta),
        torch.zeros(batch, 2, dtype=torch.long, device=meta),
        torch.arange(2, device=meta),
    )
    step = {"input_ids": (batch, 1), "position_ids": (batch, 1), "cache_position": (1,)}
    with warnings.catch_warnings():  # the cache tensors are buffers written in place, not parameters
        warnings.filterwarnings("ignore", message="A model attribute .* requires gradient")
        return wrapper, prepared_graph(wrapper, example, None, fold=False), step


def fastest_tp_within(model_factory, *, decode_ms: float, sizes=(1, 2, 4, 8), **serving) -> tuple:
    """(the smallest TP size whose decode step meets ``decode_ms``, or None; {size: ServePlan, or None where not
    one sequence fits}) over ``sizes``.  ``model_factory()`` builds the model afresh for each size (a capture
    sets its mode and config)."""
    found: dict = {}
    for size in sizes:
        try:
            found[size] = plan_serving(model_factory(), world_size=size, **serving)
        except DoesNotFit:
            found[size] = None
            continue
        if found[size].decode_seconds * 1e3 <= decode_ms:
            return size, found
    return None, found
