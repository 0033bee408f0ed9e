"""A paged KV cache and the one program that serves every step of continuous batching.

The cache of each attention layer is a pool of slots, ``[blocks × block_size, kv_heads, head_dim]``; a
sequence owns whole blocks, listed in its block table, and its token at position p lives in slot
``table[p // block_size] * block_size + p % block_size`` (vLLM's layout).  A step hands the program, per row of
its batch, the tokens to run, their positions, the slots they are written to and the row's block table, padded to
the step's width with any block (the positions past the row's own are masked).  The layer writes this step's keys
and values into their slots (``index_copy_``, a row of the op table with the KV-heads dim free) and the model's
attention reads the pool in place through the block table (``autotp::paged_attention``, runtime/
paged_attention.py: a block at a time, nothing the size of a row's context copied out), registered with
transformers as the attention implementation ``autotp_paged`` while the step program is captured.  The planner
splits the pool by KV heads as it splits the attention heads.  What a row reads is bounded by its block table,
never by a list of slots built on the host.

Every size of a step is dynamic in the one captured program: rows, tokens a row and blocks a table (a decode step
of the engine runs at the few shapes of its batch buckets, serving/step_inputs.py).  The pool's slots are zero at
the start; a slot past a row's context is read as padding and masked away.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from autotp.runtime.paged_attention import paged_attention
from autotp.serving.generation import ResidentShards, cache_keyword, dtype_of, kv_heads_and_dim

PREFIX = "model."  # the step wrapper holds the model as ``model``
ATTENTION = "autotp_paged"  # transformers' attention implementation while the step program is captured


@dataclass(frozen=True)
class PagedStep:
    """What the attention of every layer reads besides q and the pools: the step's tables and positions."""

    table: torch.Tensor  # [rows, n]
    positions: torch.Tensor  # [rows, tokens]
    block_size: int
    kinds: list  # each layer's attention kind (sliding layers see ``window`` positions back)
    window: int | None


def paged_forward(module, query, keys, values, attention_mask, scaling=None, softcap=None, autotp_paged=None, **rest):
    """transformers' attention interface over the pools a ``_PagedLayer`` returned: [rows, tokens, heads, dim]."""
    step = autotp_paged
    if step is None or rest.get("s_aux") is not None or rest.get("sinks") is not None:
        raise ValueError(f"{type(module).__name__}: the paged cache reads plain softmax attention only")
    sliding = step.kinds[module.layer_idx] == "sliding_attention"
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = paged_attention(
        query,
        keys,
        values,
        step.table,
        step.positions,
        step.block_size,
        scale,
        (step.window or 0) if sliding else 0,
        softcap or 0.0,
    )
    return out.transpose(1, 2), None


AttentionInterface.register(ATTENTION, paged_forward)


class _PagedLayer(CacheLayerMixin):
    """One attention layer's view of the pool for the current step."""

    is_compileable = True
    supports_early_init = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, width: int):
        super().__init__()
        self.pool_keys, self.pool_values, self.slots, self.width = keys, values, slots, width
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Writes this step's keys and values into their slots; returns the pools, read in place by attention."""
        heads, dim = key_states.shape[1], key_states.shape[3]
        at = self.slots.reshape(-1)
        for pool, states in ((self.pool_keys, key_states), (self.pool_values, value_states)):
            pool.index_copy_(0, at, states.transpose(1, 2).reshape(-1, heads, dim).to(pool.dtype))
        return self.pool_keys, self.pool_values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.width, 0

    def get_seq_length(self) -> int:
        return 0  # positions come with the step; nothing is counted since capture

    def get_max_length(self) -> int:
        return -1


class _StepCache(Cache):
    def __init__(self, layers: list):
        super().__init__(layers=layers)


def attention_layer_types(config) -> list[str]:
    """Each decoder layer's attention kind, from the config; a layer kind without keys and values is refused."""
    count = config.num_hidden_layers
    kinds = list(getattr(config, "layer_types", None) or [])
    if not kinds:
        windowed = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
        kinds = ["sliding_attention" if windowed else "full_attention"] * count
    other = sorted({k for k in kinds if k not in ("full_attention", "sliding_attention")})
    if other:
        raise ValueError(
            f"{type(config).__name__} has {', '.join(other)} layers: the paged KV cache serves full and "
            "sliding-window attention layers only; serve this model with autotp.generate"
        )
    return kinds


class PagedLM(torch.nn.Module):
    """model(input_ids, position_ids, slots, block_table) -> each row's last-position logits, [rows, vocab].

    ``input_ids``, ``position_ids``, ``slots``: [rows, tokens]; ``block_table``: [rows, n], the blocks of positions
    0..n × block_size - 1 of each row (a row with fewer pads with any block: masked).  Every row runs the same
    number of tokens, and a row's tokens are its last ones (positions ascending)."""

    def __init__(self, model: torch.nn.Module, blocks: int, block_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        config = model.config.get_text_config()
        self.model = model
        self.kinds = attention_layer_types(config)
        self.window = getattr(config, "sliding_window", None)
        self.block_size = block_size
        heads, dim = kv_heads_and_dim(config)
        dtype = dtype or dtype_of(model)
        meta = torch.device("meta")  # each rank allocates only its piece, zeroed (runtime/materialize.py)
        for i in range(len(self.kinds)):
            for kind in ("keys", "values"):
                self.register_buffer(
                    f"{kind}_{i}", torch.empty(blocks * block_size, heads, dim, dtype=dtype, device=meta)
                )

    def pools(self) -> list[torch.Tensor]:
        return [b for n, b in self.named_buffers() if n.startswith(("keys_", "values_"))]

    def forward(self, input_ids, position_ids, slots, block_table):
        width = block_table.shape[1] * self.block_size
        cache = _StepCache(
            [
                _PagedLayer(getattr(self, f"keys_{i}"), getattr(self, f"values_{i}"), slots, width)
                for i in range(len(self.kinds))
            ]
        )
        step = PagedStep(block_table, position_ids, self.block_size, self.kinds, self.window)
        config = self.model.config.get_text_config()
        kept, config._attn_implementation = config._attn_implementation, ATTENTION
        try:
            return self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=1,
                autotp_paged=step,
                **{cache_keyword(self.model): cache},
            ).logits[:, -1]
        finally:
            config._attn_implementation = kept


def step_program(sharded: torch.nn.Module, blocks: int, block_size: int) -> torch.nn.Module:
    """The sharded step program of ``sharded`` (a model from ``autotp.parallelize``) over a pool of ``blocks``
    blocks of ``block_size`` slots a layer, its weights the forward program's own shards (a collective).  Each rank
    holds its KV heads' piece of the pool, zeroed."""
    from autotp.api import tensor_parallel
    from autotp.options import PlanOptions, RunOptions
    from autotp.runtime.conversion import on_meta

    source = sharded.autotp_source
    training = source.training
    wrapper = PagedLM(on_meta(source), blocks, block_size).eval()  # captured weightless: the weights are shared
    where = torch.device("meta")
    rows, tokens, width = 2, 3, 5  # distinct sizes: each dim stays its own symbol
    example = (
        torch.zeros(rows, tokens, dtype=torch.long, device=where),
        torch.arange(tokens, device=where).repeat(rows, 1) + 2,
        torch.arange(tokens, device=where).repeat(rows, 1) + 2,
        torch.arange(width, device=where).repeat(rows, 1),
    )  # a table of 5 blocks
    pools = {name: tuple(pool.shape) for name, pool in wrapper.named_buffers() if name.startswith(("keys_", "values_"))}
    fixed = {PREFIX + name: sharded.autotp_plan.placement(name) for name in sharded.autotp_plan.params}
    try:
        return tensor_parallel(
            wrapper,
            example,
            None,
            PlanOptions(topology=sharded.autotp_plan.topology, training=False, fixed=fixed),
            RunOptions(
                group=sharded.autotp_group,
                device=sharded.autotp_device,
                checkpoint=ResidentShards(sharded, PREFIX, pools),
            ),
        )
    finally:
        source.train(training)
