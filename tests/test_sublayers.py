"""Sublayers the coverage sweep (benchmarks/coverage_sweep.py) found gathered or computed whole, each now split as a
hand plan splits it -- one all-reduce, nothing gathered -- and exact at 2 ranks against one process: a conformer's
convolution module (biased convs, a gate over channels, a depthwise conv, a batch norm), attention written with
the ops that had no rule (``reshape_as``, ``gather`` of relative positions, ``logsumexp``, ``max``, ``tril``),
q, k, v packed as [3, heads, head dim] and picked apart by index or ``unbind``, heads merged with the batch around
SAM's decomposed relative positions, a linear-attention mixer (a
short conv over q, k and v concatenated, a state begun with ``new_zeros``, a gated norm on flattened rows), and
layer norms over a width split by heads or columns (each by its statistics: a number a row summed over the ranks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL

C, HEADS, D = 16, 4, 8
GRID = 3  # MergedRelativePositions' tokens: a GRID x GRID grid
# its position tables are a 20th of its projection's weight here (SAM's: a 1000th), so not only offered sharded
TABLES_WHOLE = {"min_shard_fraction": 0.1}
RUN = {"x": [8, 4096, C]}  # priced at a run's tokens: a norm's statistics are then far cheaper than its activation


class ConvModule(nn.Module):
    """Parakeet's, Canary's and wav2vec2-conformer's: pointwise conv to 2C, glu over channels, depthwise conv,
    batch norm, SiLU, pointwise conv back, each conv with a bias; a residual around it."""

    def __init__(self):
        super().__init__()
        self.pointwise1 = nn.Conv1d(C, 2 * C, 1)
        self.depthwise = nn.Conv1d(C, C, 3, padding="same", groups=C)
        self.norm = nn.BatchNorm1d(C)
        self.pointwise2 = nn.Conv1d(C, C, 1)

    def forward(self, x):
        h = nn.functional.glu(self.pointwise1(x.transpose(1, 2)), dim=1)
        h = self.pointwise2(nn.functional.silu(self.norm(self.depthwise(h))))
        return x + h.transpose(1, 2)


class RelativeAttention(nn.Module):
    """Scores plus a bias gathered per head from a table of relative positions (DeBERTa's ``gather``), a causal
    mask by ``tril``, softmax written as ``exp(s - logsumexp(s))`` after subtracting the row ``max``, and heads
    merged back with ``reshape_as`` (RoFormer's)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(C, HEADS * D, bias=False) for _ in range(3))
        self.o = nn.Linear(HEADS * D, C, bias=False)
        self.table = nn.Parameter(torch.randn(HEADS, 15) / 4)

    def forward(self, x, positions):
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, HEADS, D).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / D**0.5  # [b, h, s, s]
        bias = self.table[None, :, None, :].expand(b, HEADS, s, 15)
        scores = scores + torch.gather(bias, -1, positions[:, None].expand(b, HEADS, s, s))
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).tril().logical_not(), -1e4)
        scores = scores - scores.max(-1, keepdim=True).values
        weights = torch.exp(scores - torch.logsumexp(scores, -1, keepdim=True))
        out = (weights @ v).transpose(1, 2)
        return x + self.o(out.reshape_as(torch.empty(b, s, HEADS * D)))


class PackedHeads(nn.Module):
    """q, k and v packed as [3, heads, head dim] and picked by index (BLIP's ``qkv[0], qkv[1], qkv[2]`` after a
    permute) or by ``unbind`` (ModernBERT's): each rank's heads of all three."""

    def __init__(self, unbind: bool):
        super().__init__()
        self.unbind = unbind
        self.qkv = nn.Linear(C, 3 * HEADS * D)
        self.o = nn.Linear(HEADS * D, C)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(x).reshape(b, s, 3, HEADS, D)
        if self.unbind:
            q, k, v = qkv.transpose(3, 1).unbind(dim=2)  # [b, heads, s, d] each
        else:
            qkv = qkv.permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
        out = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1)
        return x + self.o(out)


class MergedRelativePositions(nn.Module):
    """SAM's and ViTDet's attention over a grid of tokens: q, k and v picked from [3, batch * heads, tokens, d],
    a relative-position bias decomposed into two einsums over the rows and columns of the grid on q viewed as
    [batch * heads, h, w, d], unsqueezed, added and viewed as [batch, heads, tokens, tokens]; the scores by SDPA
    with that bias as its mask, or (PP-FormulaNet's) by a 3-D matmul, softmax and a second matmul."""

    def __init__(self, sdpa: bool):
        super().__init__()
        self.sdpa = sdpa
        self.qkv, self.o = nn.Linear(C, 3 * HEADS * D), nn.Linear(HEADS * D, C)
        self.rows, self.cols = (nn.Parameter(torch.randn(GRID, GRID, D) / 4) for _ in range(2))

    def forward(self, x):
        b, n, _ = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, HEADS, D).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.reshape(3, b * HEADS, n, D).unbind(0)
        grid = q.reshape(b * HEADS, GRID, GRID, D)
        rows, cols = torch.einsum("bhwc,hkc->bhwk", grid, self.rows), torch.einsum("bhwc,wkc->bhwk", grid, self.cols)
        bias = (rows[:, :, :, :, None] + cols[:, :, :, None, :]).reshape(b, HEADS, n, n)
        if self.sdpa:
            out = nn.functional.scaled_dot_product_attention(*(t.view(b, HEADS, n, D) for t in (q, k, v)), bias)
        else:
            scores = (q * D**-0.5) @ k.transpose(-2, -1) + bias.reshape(b * HEADS, n, n)
            out = (scores.softmax(-1) @ v).reshape(b, HEADS, n, D)
        return x + self.o(out.transpose(1, 2).reshape(b, n, -1))


class MergedScaledKeys(nn.Module):
    """DeBERTa's attention: q, k and v viewed as [batch * heads, tokens, d], the keys transposed and divided by a
    0-d tensor before a bmm, the scores viewed back as [batch, heads, tokens, tokens]."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(C, HEADS * D) for _ in range(3))
        self.o = nn.Linear(HEADS * D, C)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (
            p(x).view(b, s, HEADS, D).permute(0, 2, 1, 3).contiguous().view(-1, s, D) for p in (self.q, self.k, self.v)
        )
        scale = torch.sqrt(torch.tensor(D, dtype=torch.float))
        scores = torch.bmm(q, k.transpose(-1, -2) / scale.to(q.dtype)).view(b, HEADS, s, s)
        out = torch.matmul(scores.softmax(-1), v.view(b, HEADS, s, D))
        return x + self.o(out.permute(0, 2, 1, 3).reshape(b, s, -1))


class TableBiases(nn.Module):
    """LeViT's attention biases: a [heads, offsets] table read as [heads, n, n] by ``table[:, idxs]``."""

    def __init__(self, n: int = 8):
        super().__init__()
        self.qkv, self.o = nn.Linear(C, 3 * HEADS * D), nn.Linear(HEADS * D, C)
        self.table = nn.Parameter(torch.randn(HEADS, n) / 4)
        pos = torch.arange(n)
        self.register_buffer("idxs", (pos[:, None] - pos[None, :]).abs(), persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, D).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) * D**-0.5 + self.table[:, self.idxs]
        return x + self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1))


class MergedEinsums(nn.Module):
    """Perceiver's attention (einops): q, k and v as [batch * heads, tokens, d], ``einsum('bid,bjd->bij')`` and
    ``einsum('bij,bjd->bid')`` of two merges each."""

    def __init__(self):
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(C, HEADS * D), nn.Linear(C, 2 * HEADS * D), nn.Linear(HEADS * D, C)

    def forward(self, x):
        b, s, _ = x.shape
        k, v = self.kv(x).chunk(2, dim=-1)
        q, k, v = (t.reshape(b, s, HEADS, D).permute(0, 2, 1, 3).reshape(b * HEADS, s, D) for t in (self.q(x), k, v))
        weights = torch.einsum("bid,bjd->bij", q, k).mul(D**-0.5).softmax(-1)
        out = torch.einsum("bij,bjd->bid", weights, v).reshape(b, HEADS, s, D).permute(0, 2, 1, 3)
        return x + self.o(out.reshape(b, s, HEADS * D))


class LinearAttention(nn.Module):
    """Qwen3-Next's gated delta net in outline: q, k and v cut from one projection and concatenated again for a
    causal depthwise conv, then cut apart; a state begun with ``new_zeros``; each head's output row normalized and
    gated on rows flattened from [b, s, heads, d] (the gate from [b, s, heads * d])."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * HEADS * D, bias=False)
        self.z = nn.Linear(C, HEADS * D, bias=False)
        self.conv = nn.Conv1d(3 * HEADS * D, 3 * HEADS * D, 4, groups=3 * HEADS * D, padding=3, bias=False)
        self.norm = nn.Parameter(1 + torch.randn(D) / 4)
        self.o = nn.Linear(HEADS * D, C, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        mixed = torch.cat(self.qkv(x).split(HEADS * D, -1), -1).transpose(1, 2)
        mixed = nn.functional.silu(self.conv(mixed)[..., :s]).transpose(1, 2)
        q, k, v = (t.reshape(b, s, HEADS, D).transpose(1, 2) for t in mixed.split(HEADS * D, -1))
        state = x.new_zeros(b, HEADS, D, D) + k.transpose(-1, -2) @ v / s
        out = (q @ state + (q @ k.transpose(-1, -2)).tril() @ v).transpose(1, 2)  # [b, s, heads, d]
        rows, gate = out.reshape(-1, D), self.z(x).reshape(-1, D)
        rows = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm * nn.functional.silu(gate)
        return x + self.o(rows.reshape(b, s, HEADS, D).reshape(b, s, -1))


class SubNorms(nn.Module):
    """Layer norms over a split width: q and k each normalized over all heads (ESM-C, OLMo-2), the attention's
    output normalized before its projection and the MLP's hidden before its second matrix (Magneto's sub-LN)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.ModuleList(nn.Linear(C, HEADS * D) for _ in range(3))
        self.q_norm, self.k_norm, self.inner = (nn.LayerNorm(HEADS * D) for _ in range(3))
        self.o = nn.Linear(HEADS * D, C)
        self.up, self.hidden_norm, self.down = nn.Linear(C, 4 * C), nn.LayerNorm(4 * C), nn.Linear(4 * C, C)
        for norm in (self.q_norm, self.k_norm, self.inner, self.hidden_norm):
            nn.init.normal_(norm.weight, 1, 0.25)
            nn.init.normal_(norm.bias, 0, 0.25)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (f(x) for f in self.qkv)
        q, k, v = (t.view(b, s, HEADS, D).transpose(1, 2) for t in (self.q_norm(q), self.k_norm(k), v))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.o(self.inner(out))
        return x + self.down(self.hidden_norm(nn.functional.gelu(self.up(x))))


def _inputs(b: int, s: int) -> dict:
    positions = (torch.arange(s)[None, :] - torch.arange(s)[:, None] + 7).clamp(0, 14)
    return {"x": torch.randn(b, s, C), "positions": positions.expand(b, s, s)}


def all_reduces_worth(plan) -> float:
    """The forward's collectives of activations in all-reduces: an all-gather or a reduce-scatter is half of one (a
    ring all-reduce is one of each, of the same bytes); anything else fails.  A norm's statistics (at most a number
    a row of the width, under a 16th of an activation's bytes here) are not counted."""
    worth = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5}
    largest = max((c["bytes"] for c in plan.collectives), default=0)
    return sum(
        worth[c["op"]] * c.get("count", 1)
        for c in plan.collectives
        if c["phase"] == "forward" and c["bytes"] * 16 > largest
    )


def statistics(plan) -> int:
    largest = max((c["bytes"] for c in plan.collectives), default=0)
    return sum(c.get("count", 1) for c in plan.collectives if c["phase"] == "forward" and c["bytes"] * 16 <= largest)


def _exact(model, kwargs: dict, others: list[dict], sums: int = 1, **options) -> None:
    sharded = autotp.parallelize(model, (), kwargs, **options)
    assert all_reduces_worth(sharded.autotp_plan) <= sums, sharded.autotp_plan.collectives  # Megatron's
    for inputs in (kwargs, *others):
        torch.testing.assert_close(sharded(**inputs), model(**inputs), **TOL)
    sharded(**kwargs).square().mean().backward()
    model(**kwargs).square().mean().backward()
    grads = autotp.full_state_dict(sharded, grads=True)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL)


def _run(rank: int, world: int) -> None:
    torch.manual_seed(0)
    conv = ConvModule().eval()  # batch norm of fixed statistics, as in inference (and the sweep)
    conv.norm.running_mean.uniform_(-0.5, 0.5)
    conv.norm.running_var.uniform_(0.5, 1.5)
    _exact(conv, {"x": torch.randn(2, 8, C)}, [{"x": torch.randn(1, 1, C)}, {"x": torch.randn(3, 5, C)}])
    torch.manual_seed(0)
    _exact(RelativeAttention(), _inputs(2, 8), [_inputs(1, 1), _inputs(3, 5)])
    for unbind in (False, True):
        torch.manual_seed(0)
        _exact(PackedHeads(unbind), {"x": torch.randn(2, 8, C)}, [{"x": torch.randn(1, 1, C)}])
    torch.manual_seed(0)
    _exact(LinearAttention(), {"x": torch.randn(2, 8, C)}, [{"x": torch.randn(1, 1, C)}, {"x": torch.randn(3, 5, C)}])
    for sdpa in (True, False):
        torch.manual_seed(0)
        _exact(
            MergedRelativePositions(sdpa),
            {"x": torch.randn(2, GRID * GRID, C)},
            [{"x": torch.randn(1, GRID * GRID, C)}, {"x": torch.randn(3, GRID * GRID, C)}],
            **TABLES_WHOLE,
        )
    torch.manual_seed(0)
    _exact(MergedScaledKeys(), {"x": torch.randn(2, 8, C)}, [{"x": torch.randn(1, 1, C)}, {"x": torch.randn(3, 5, C)}])
    torch.manual_seed(0)
    _exact(
        TableBiases(),
        {"x": torch.randn(2, 8, C)},
        [{"x": torch.randn(1, 8, C)}, {"x": torch.randn(3, 8, C)}],
        min_shard_fraction=0.001,
    )
    torch.manual_seed(0)
    _exact(MergedEinsums(), {"x": torch.randn(2, 8, C)}, [{"x": torch.randn(1, 1, C)}, {"x": torch.randn(3, 5, C)}])
    torch.manual_seed(0)
    _exact(
        SubNorms(),
        {"x": torch.randn(2, 8, C)},
        [{"x": torch.randn(1, 1, C)}, {"x": torch.randn(3, 5, C)}],
        2,
        price_at=RUN,
    )


@pytest.mark.parametrize("unbind", [False, True])
def test_packed_heads_picked_by_index_split_by_heads(unbind):
    """The packed projection's rows split block by block: each rank the same heads of q, of k and of v."""
    plan = autotp.plan(PackedHeads(unbind), (), {"x": torch.randn(2, 8, C)}, world_size=2)
    assert plan.params["qkv.weight"] == f"S(0|{HEADS * D},{HEADS * D},{HEADS * D})", plan.params
    assert plan.params["o.weight"] == "S(1)" and not plan.replicated_ops, plan.params


def test_split_by_channels_and_heads_with_one_all_reduce_and_exact():
    run_ranks(2, _run)


def test_the_convs_split_by_channels_in_matching_gate_halves():
    """The first pointwise conv's rows split block by block (each rank the same channels of both halves), the
    depthwise conv and the norm by channels, nothing computed whole (before: the gate's input gathered)."""
    plan = autotp.plan(ConvModule().eval(), (), {"x": torch.randn(2, 8, C)}, world_size=2)
    assert plan.params["pointwise1.weight"] == plan.params["pointwise1.bias"] == f"S(0|{C},{C})", plan.params
    assert plan.params["depthwise.weight"] == plan.params["norm.weight"] == "S(0)", plan.params
    assert plan.params["pointwise2.weight"] != "R" and not plan.replicated_ops, plan.params


def test_linear_attention_split_by_heads_through_its_conv_and_gated_norm():
    """The short conv's channels split block by block (each rank the same heads of q, k and v), the gate's
    projection by heads, nothing computed whole (before: the conv's input, the state and the norm's rows gathered)."""
    plan = autotp.plan(LinearAttention(), (), {"x": torch.randn(2, 8, C)}, world_size=2)
    blocks = f"S(0|{HEADS * D},{HEADS * D},{HEADS * D})"
    assert plan.params["qkv.weight"] == plan.params["conv.weight"] == blocks, plan.params
    assert plan.params["z.weight"] == "S(0)" and plan.params["o.weight"] == "S(1)", plan.params
    assert not plan.replicated_ops and all_reduces_worth(plan) <= 1, plan.collectives


def test_norms_over_a_split_width_split_by_their_statistics():
    """Each norm's width split as its projection's output is (heads, the MLP's columns), its weight and bias alike:
    two all-reduces of activations, as Megatron's, and two of statistics a norm (before: q, k, the attention's output
    and the MLP's hidden gathered)."""
    plan = autotp.plan(SubNorms(), (), {"x": torch.randn(2, 8, C)}, world_size=2, price_at=RUN)
    for norm in ("q_norm", "k_norm", "inner", "hidden_norm"):
        assert plan.params[f"{norm}.weight"] == plan.params[f"{norm}.bias"] == "S(0)", plan.params
    assert plan.params["o.weight"] == plan.params["down.weight"] == "S(1)" and not plan.replicated_ops, plan.params
    assert all_reduces_worth(plan) <= 2 and statistics(plan) == 8, plan.collectives


@pytest.mark.parametrize("sdpa", [True, False])
def test_heads_merged_with_the_batch_around_relative_positions_split_by_heads(sdpa):
    """q, k and v's projection split block by block, the relative-position einsums and the scores by heads, one
    all-reduce (before: the heads merged with the batch were gathered, attention computed whole)."""
    plan = autotp.plan(
        MergedRelativePositions(sdpa), (), {"x": torch.randn(2, GRID * GRID, C)}, world_size=2, **TABLES_WHOLE
    )
    assert plan.params["qkv.weight"] == f"S(0|{HEADS * D},{HEADS * D},{HEADS * D})", plan.params
    assert plan.params["o.weight"] == "S(1)" and not plan.replicated_ops, plan.params
    assert all_reduces_worth(plan) <= 1, plan.collectives


def test_merged_keys_transposed_and_scaled_split_by_heads():
    """The transpose and the division by a 0-d scale of merged keys moved past the merge: q, k and v split by heads,
    the bmm and softmax by heads, one all-reduce (before: the bmm computed whole)."""
    plan = autotp.plan(MergedScaledKeys(), (), {"x": torch.randn(2, 8, C)}, world_size=2)
    assert all(plan.params[f"{p}.weight"] == "S(0)" for p in "qkv") and plan.params["o.weight"] == "S(1)", plan.params
    softmax = [v for v in plan.nodes.values() if "softmax" in v["op"]]
    assert softmax and all(v["out"] == "S(1)" for v in softmax) and all_reduces_worth(plan) <= 1, plan.collectives


def test_a_table_read_past_its_heads_dim_split_by_heads():
    """``table[:, idxs]`` keeps the table's heads dim: the table split by heads as the scores are, nothing computed
    whole (before: an index with a leading whole dim had no rule)."""
    plan = autotp.plan(TableBiases(), (), {"x": torch.randn(2, 8, C)}, world_size=2, min_shard_fraction=0.001)
    assert plan.params["table"] == "S(0)" and not plan.replicated_ops, (plan.params, plan.replicated_ops)
    assert all_reduces_worth(plan) <= 1, plan.collectives


def test_einsums_of_two_merges_split_by_heads():
    """Both einsums' merged operands unmerged together: the scores and softmax split by heads, k and v's packed
    projection block by block, one all-reduce (before: q, k and v gathered, attention computed whole)."""
    plan = autotp.plan(MergedEinsums(), (), {"x": torch.randn(2, 8, C)}, world_size=2)
    softmax = [v for v in plan.nodes.values() if "softmax" in v["op"]]
    assert softmax and all(v["out"] == "S(1)" for v in softmax), softmax
    assert plan.params["kv.weight"] == f"S(0|{HEADS * D},{HEADS * D})" and plan.params["o.weight"] == "S(1)"
    assert all_reduces_worth(plan) <= 1 and not plan.replicated_ops, plan.collectives


class NormOnTheStream(nn.Module):
    """A conformer's first norm: on its input projection's output, which the residual add reads too."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm, self.ff = nn.Linear(C, C), nn.LayerNorm(C), nn.Linear(C, C)

    def forward(self, x):
        x = self.proj(x)
        return x + self.ff(self.norm(x))


def test_norms_are_spelled_out_inside_a_sublayer_only():
    """A norm only its projection's output reaches is written as its statistics; one on a value the residual add
    reads stays one fused op (nothing to split there that an all-reduce of the stream would not do first)."""
    from autotp.passes.prepared_graph import prepared_graph

    fused = [
        n
        for n in prepared_graph(SubNorms(), (), {"x": torch.randn(2, 8, C)}).graph.nodes
        if n.target == torch.ops.aten.layer_norm.default
    ]
    kept = [
        n
        for n in prepared_graph(NormOnTheStream(), (), {"x": torch.randn(2, 8, C)}).graph.nodes
        if n.target == torch.ops.aten.layer_norm.default
    ]
    assert not fused and len(kept) == 1, (fused, kept)
