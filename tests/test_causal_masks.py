"""A mask built from sizes alone becomes attention's ``is_causal`` only where it is proved causal
(canonicalize/causal_masks.py); keys and values repeated per query head reach a rank's kernel unrepeated
(ops/local_forms.attention).  Graph level, no ranks: whether the sharded programs stay exact is what
tests/test_architectures.py and the other end-to-end tests check."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autotp.passes.prepared_graph import prepared_graph
from tests.helpers import configs
from tests.helpers.exact import TOL

aten = torch.ops.aten


def _attention(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target == aten.scaled_dot_product_attention.default]


def _causal(node: torch.fx.Node) -> bool:
    return bool(node.kwargs.get("is_causal")) and _unmasked(node)


def _unmasked(node: torch.fx.Node) -> bool:
    return node.kwargs.get("attn_mask") is None and len(node.args) == 3


class SizedMask(torch.nn.Module):
    """Attention under a mask built from the sequence length by ``rule(key index, query index)``, or by
    ``rule(length)`` with ``triangle``; ``shift``: the indices read through ``arange(s)[arange(s) - shift]``, which
    wraps the first ones around to the end."""

    def __init__(self, rule, shift: int = 0, triangle: bool = False):
        super().__init__()
        self.rule, self.shift, self.triangle = rule, shift, triangle

    def forward(self, x):
        if self.triangle:
            return F.scaled_dot_product_attention(x, x, x, attn_mask=self.rule(x.shape[2]))
        positions = torch.arange(x.shape[2], device=x.device)
        if self.shift:
            positions = positions[positions - self.shift]
        mask = self.rule(positions[None, :], positions[:, None])
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)


RULES = {  # name: (mask, what attention becomes: causal, unmasked or left masked)
    "causal": (lambda key, query: key <= query, "causal"),
    "causal, written as query >= key": (lambda key, query: query >= key, "causal"),
    "causal and a tautology": (lambda key, query: (key <= query) & (key >= 0), "causal"),
    "strictly causal (empty first row)": (lambda key, query: key < query, "masked"),
    "anti-causal": (lambda key, query: key >= query, "masked"),
    "a sliding window": (lambda key, query: (key <= query) & (key > query - 3), "masked"),
    "everything": (lambda key, query: (key >= 0) | (key > query), "unmasked"),
    "everything but the first key": (lambda key, query: key > 0, "masked"),
}


TRIANGLES = {  # name: (mask of a length, what attention becomes)
    "ones, lower triangle": (lambda s: torch.ones(s, s, dtype=torch.bool).tril(), "causal"),
    "not the upper triangle above the diagonal": (lambda s: ~torch.ones(s, s, dtype=torch.bool).triu(1), "causal"),
    "full of true, lower triangle": (lambda s: torch.full((s, s), True).tril(), "causal"),
    "lower triangle below the diagonal": (lambda s: torch.ones(s, s, dtype=torch.bool).tril(-1), "masked"),
    "a band": (lambda s: torch.ones(s, s, dtype=torch.bool).tril().triu(-2), "masked"),
}


@pytest.mark.parametrize("name", [*RULES, "causal on indices that wrap around", *TRIANGLES])
def test_only_a_mask_proved_causal_or_true_is_dropped(name):
    if name in TRIANGLES:
        (rule, becomes), triangle = TRIANGLES[name], True
    else:
        (rule, becomes), triangle = RULES.get(name, (RULES["causal"][0], "masked")), False
    model, x = SizedMask(rule, shift=int("wrap" in name), triangle=triangle), torch.randn(2, 3, 6, 4)
    gm = prepared_graph(model, (x,))
    (node,) = _attention(gm)
    assert _causal(node) == (becomes == "causal")
    assert _unmasked(node) == (becomes != "masked")
    y = torch.randn(3, 3, 9, 4)  # another batch and length than captured
    torch.testing.assert_close(gm(y), model(y))


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_a_captured_model_runs_attention_without_its_mask(family):
    """LLaMA's traced causal mask: is_causal; BERT's mask without padding, all true: none."""
    import transformers

    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(configs.llama()).eval()
    else:
        model = transformers.BertModel(configs.architecture("bert")).eval()
    gm = prepared_graph(model, (torch.randint(0, 96, (2, 8)),))
    nodes = _attention(gm)
    assert len(nodes) == 2 and all(_unmasked(n) and _causal(n) == (family == "llama") for n in nodes)
    assert not [n for n in gm.graph.nodes if n.target in (aten.cumsum.default, aten.diff.default, aten.le.Tensor)]
    for shape in ((1, 1), (3, 5)):
        ids = torch.randint(0, 96, shape)
        torch.testing.assert_close(gm(ids)[0], model(ids)[0], **TOL)


@pytest.mark.parametrize(
    "what",
    [
        "padding mask given",  # the mask reads an input tensor
        "positions given",  # transformers looks for packed sequences in them
        "sliding window",
    ],
)
def test_masks_that_read_inputs_or_slide_stay(what):
    import transformers

    torch.manual_seed(0)
    ids = torch.randint(0, 96, (2, 8))
    kwargs = {}
    if what == "sliding window":
        model = transformers.MistralForCausalLM(configs.architecture("mistral")).eval()
    else:
        model = transformers.LlamaForCausalLM(configs.llama()).eval()
        name, value = (
            ("attention_mask", torch.ones(2, 8, dtype=torch.long))
            if what == "padding mask given"
            else ("position_ids", torch.arange(8).expand(2, 8))
        )
        kwargs = {name: value}
    gm = prepared_graph(model, (ids,), kwargs or None)
    assert not any(_causal(n) for n in _attention(gm))


def _attention_reads(world: int) -> list:
    """(enable_gqa, what the keys come from) of each attention call in rank 0's program of a LLaMA with 4 query
    heads sharing 2 KV heads, at TP ``world`` (a fake process group)."""
    from transformers import LlamaForCausalLM

    import autotp

    torch.manual_seed(0)
    sharded = autotp.parallelize(LlamaForCausalLM(configs.llama()), (torch.randint(0, 96, (2, 8)),))
    return [
        (n.kwargs.get("enable_gqa"), getattr(n.args[1].target, "__name__", str(n.args[1].target)))
        for n in sharded.graph.nodes
        if n.target == aten.scaled_dot_product_attention.default
    ]


@pytest.mark.parametrize("world", [2, 4])
def test_a_ranks_whole_kv_groups_reach_attention_unrepeated(world):
    """TP 2: each rank's 2 query heads share its one KV head: unrepeated (enable_gqa).  TP 4: a rank's one query
    head is half a group: its repeat stays."""
    from tests.helpers.async_tp import in_fake_world

    reads = in_fake_world(world, _attention_reads, world)
    assert len(reads) == 2
    if world == 2:
        assert all(gqa and source == "narrow.default" for gqa, source in reads), reads
    else:
        assert all(not gqa and source == "repeat_heads" for gqa, source in reads), reads


def test_whole_groups():
    from autotp.ops.keeps import whole_groups
    from autotp.placement import R, Shard

    assert whole_groups(R, 8, 4, 4)
    assert whole_groups(Shard(1), 8, 2, 2) and whole_groups(Shard(1), 8, 2, 4)
    assert not whole_groups(Shard(1), 8, 4, 4)  # two query heads a rank, half a group
    assert not whole_groups(Shard(2), 8, 2, 2)


@pytest.mark.parametrize(("world", "placement"), [(2, "S(1)"), (4, "S(1)"), (2, "R")])
def test_the_plan_prices_kv_kept_as_the_rank_keeps_them(world, placement):
    """K and V kept for the backward, priced: unrepeated (2 KV heads of 4 query heads) where each rank's query heads
    are whole groups (S(1) at TP 2, or all of them), repeated where it holds half a group (TP 4)."""
    from transformers import LlamaForCausalLM

    from autotp.cost_models.pricing import Sizes, kept_bytes
    from autotp.ops.strategies import Strategy, input_slots
    from autotp.placement import parse

    torch.manual_seed(0)
    gm = prepared_graph(LlamaForCausalLM(configs.llama()), (torch.randint(0, 96, (2, 8)),))
    node = _attention(gm)[0]
    layout = parse(placement)
    strategy = Strategy(tuple(layout for _ in input_slots(node)), layout)
    key, sizes = node.args[1], Sizes()  # the example's sizes
    held = {k[0]: b for k, b in kept_bytes(node, strategy, sizes, world, set(gm.graph.nodes))}
    share = 1 if placement == "R" else 1 / world
    repeated = sizes.numel(key) * 4 * share  # fp32
    unrepeated = sizes.numel(key.args[0]) * 4 * share
    assert repeated == 2 * unrepeated
    assert held[key] == (repeated if world == 4 else unrepeated)
