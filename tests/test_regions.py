"""Autocast and no-grad blocks inside a forward (a rotary embedding computed with autocast off, as einops-style
libraries write it) are inlined between the calls that enter and leave their mode: the rules see their ops, so
attention is split by heads, and the region keeps its meaning under the user's autocast."""

from __future__ import annotations

import torch
from torch import nn

import autotp
from autotp.passes.prepared_graph import prepared_graph
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL, forward_matches, sums_per_block, training_matches

HEADS, DIM, VOCAB = 4, 32, 64


class RotaryAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, DIM // HEADS, 2) / (DIM // HEADS)))

    def rotate(self, x):
        with torch.autocast("cpu", enabled=False):  # rotary in float32 whatever the caller's autocast
            t = torch.arange(x.shape[2], dtype=torch.float32)
            freqs = torch.einsum("i,j->ij", t, self.inv_freq)
            freqs = torch.cat((freqs, freqs), -1)
            x1, x2 = x.float().reshape(*x.shape[:-1], 2, -1).unbind(-2)
            rotated = torch.cat((-x2, x1), -1)
            return (x.float() * freqs.cos() + rotated * freqs.sin()).type_as(x)

    def forward(self, h):
        b, s, _ = h.shape
        q, k, v = (f(h).view(b, s, HEADS, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        with torch.no_grad():  # a gate the forward reads but never differentiates
            gate = (q.detach().float().abs() < 1e4).to(q.dtype)
        out = nn.functional.scaled_dot_product_attention(self.rotate(q * gate), self.rotate(k), v, is_causal=True)
        return h + self.o(out.transpose(1, 2).reshape(b, s, DIM))


class Decoder(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(RotaryAttention() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def test_regions_are_inlined_between_their_mode_calls():
    gm = prepared_graph(Decoder(1), (torch.randint(0, VOCAB, (2, 8)),))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert not [t for t in targets if isinstance(t, torch._ops.HigherOrderOperator)], targets
    assert targets.count(torch.amp._enter_autocast) == targets.count(torch.amp._exit_autocast) == 2
    assert torch._C._set_grad_enabled in targets
    ids = torch.randint(0, VOCAB, (3, 5))
    torch.testing.assert_close(gm(ids), Decoder(1)(ids), **TOL)


def _split(rank: int, world: int) -> None:
    model = Decoder()
    sharded = autotp.parallelize(model, (torch.randint(0, VOCAB, (2, 8)),))
    plan = sharded.autotp_plan
    assert plan.replicated_ops == [] and set(sums_per_block(plan).values()) == {1}, plan.collectives  # attention only
    assert plan.collective_counts("forward")["all_gather"] <= 2, plan.collectives  # the embedding and the head
    forward_matches(model, sharded, [(torch.randint(0, VOCAB, (3, 5)),), (torch.randint(0, VOCAB, (1, 1)),)])
    ids = torch.randint(0, VOCAB, (2, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the rotary stays float32 in both
        torch.testing.assert_close(sharded(ids), model(ids), atol=2e-2, rtol=2e-2)  # bf16 products, summed apart
    training_matches(model, sharded, [(torch.randint(0, VOCAB, (2, 6)),) for _ in range(2)])


def test_attention_with_an_autocast_rotary_is_split_by_heads():
    run_ranks(2, _split)
