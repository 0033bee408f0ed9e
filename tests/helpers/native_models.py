"""Tiny models written the way PyTorch-native training code writes them (random weights, fixed seeds): rotary
embeddings with complex numbers, FlexAttention, PyTorch's own transformer layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

VOCAB = 64


def rotation_table(head_dim: int, positions: int, theta: float = 10000.0) -> torch.Tensor:
    """e^(i t f) for every position t and frequency f: a complex64 [positions, head_dim / 2] table."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [b, s, heads, d] rotated pairwise by the table's complex numbers."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    turned = torch.view_as_real(pairs * table.view(1, x.shape[1], 1, -1)).flatten(3)
    return turned.type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class ComplexAttention(nn.Module):
    """Separate q/k/v projections, complex rotary on q and k, grouped KV heads repeated for SDPA."""

    def __init__(self, dim: int, heads: int, kv_heads: int, repeat: str):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.repeat = heads, kv_heads, dim // heads, repeat
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def _repeat(self, x, n: int):
        if n == 1:
            return x
        if self.repeat == "interleave":
            return x.repeat_interleave(n, dim=2)
        b, s, kv, d = x.shape
        return x[:, :, :, None, :].expand(b, s, kv, n, d).reshape(b, s, kv * n, d)

    def forward(self, x, table):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = rotate(q, table), rotate(k, table)
        n = self.heads // self.kv_heads
        k, v = self._repeat(k, n), self._repeat(v, n)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ComplexBlock(nn.Module):
    def __init__(self, dim, heads, kv_heads, hidden, repeat):
        super().__init__()
        self.attention = ComplexAttention(dim, heads, kv_heads, repeat)
        self.feed_forward = SwiGLU(dim, hidden)
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)

    def forward(self, x, table):
        h = x + self.attention(self.attention_norm(x), table)
        return h + self.feed_forward(self.ffn_norm(h))


class ComplexRotaryLM(nn.Module):
    """A LLaMA whose rotary embedding is a complex64 buffer (``torch.polar``), cut to the sequence in forward."""

    def __init__(
        self,
        dim: int = 32,
        layers: int = 2,
        heads: int = 4,
        kv_heads: int = 2,
        hidden: int = 64,
        positions: int = 32,
        repeat: str = "expand",
    ):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(ComplexBlock(dim, heads, kv_heads, hidden, repeat) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, VOCAB, bias=False)
        self.register_buffer("freqs_cis", rotation_table(dim // heads, positions))

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        table = self.freqs_cis[0 : tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, table)
        return self.output(self.norm(h))


def complex_rotary_lm(**config) -> ComplexRotaryLM:
    torch.manual_seed(0)
    return ComplexRotaryLM(**config)


def greedy(model: nn.Module, ids: torch.Tensor, new: int) -> torch.Tensor:
    """The model's own greedy loop: the whole sequence again for every token."""
    with torch.no_grad():
        for _ in range(new):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


class EncoderLM(nn.Module):
    """An nn.TransformerEncoder language model: causal mask, optional key padding mask, batch first or not."""

    def __init__(
        self, dim: int = 32, heads: int = 4, layers: int = 2, batch_first: bool = True, norm_first: bool = False
    ):
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(VOCAB, dim)
        layer = nn.TransformerEncoderLayer(
            dim, heads, 2 * dim, dropout=0.0, batch_first=batch_first, norm_first=norm_first
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, ids, padding=None):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        h = self.emb(ids)
        h = h if self.batch_first else h.transpose(0, 1)
        h = self.encoder(h, mask=mask, is_causal=True, src_key_padding_mask=padding)
        return self.head(h if self.batch_first else h.transpose(0, 1))


class WeightsLM(nn.Module):
    """nn.MultiheadAttention called as its docs show, sequence first and ``need_weights`` left on: the bmm path of
    F.multi_head_attention_forward (heads merged with the batch into [S, B*H, hd], ``baddbmm`` with the mask, the
    weights averaged over heads); the last block's largest weight a row added to the logits."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.attention = nn.ModuleList(nn.MultiheadAttention(dim, heads) for _ in range(layers))
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)) for _ in range(layers)
        )
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, ids):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        h = self.emb(ids).transpose(0, 1)
        for attention, mlp in zip(self.attention, self.mlp, strict=True):
            out, weights = attention(h, h, h, attn_mask=mask)
            h = h + out
            h = h + mlp(h)
        return self.head(h.transpose(0, 1)) + weights.amax(-1, keepdim=True)


class DecoderLM(nn.Module):
    """An encoder layer, then nn.TransformerDecoderLayer blocks (causal self-attention, cross-attention on the
    encoded sequence, MLP)."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2, batch_first: bool = False):
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(VOCAB, dim)
        self.encoder = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=batch_first)
        self.layers = nn.ModuleList(
            nn.TransformerDecoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=batch_first) for _ in range(layers)
        )
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, ids):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        h = self.emb(ids)
        h = h if self.batch_first else h.transpose(0, 1)
        memory = self.encoder(h)
        for layer in self.layers:
            h = layer(h, memory, tgt_mask=mask, tgt_is_causal=True)
        return self.head(h if self.batch_first else h.transpose(0, 1))


def torch_layers_lm(kind: str = "encoder", **config) -> nn.Module:
    torch.manual_seed(0)
    return {"encoder": EncoderLM, "decoder": DecoderLM, "weights": WeightsLM}[kind](**config)


def causal(b, h, q, kv):
    return q >= kv


class FlexAttention(nn.Module):
    """q, k and v from one fused projection, FlexAttention with grouped KV heads; ``mode`` picks the score and mask
    functions: a causal BlockMask given as input or built in forward, ALiBi slopes from the head index or read from a
    per-head buffer, a tanh soft cap."""

    def __init__(self, mode: str, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.mode, self.heads, self.kv_heads, self.head_dim = mode, heads, kv_heads, dim // heads
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.register_buffer("slopes", torch.exp2(-8.0 * torch.arange(1, heads + 1) / heads))

    def forward(self, x, block_mask=None):
        b, s, _ = x.shape
        heads, kv, d = self.heads, self.kv_heads, self.head_dim
        q, k, v = self.qkv(x).split([heads * d, kv * d, kv * d], -1)
        q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in (q, k, v))
        if self.mode == "forward_mask":
            block_mask = create_block_mask(causal, None, None, s, s, device=x.device)
        score_mod = None
        if self.mode == "alibi_h":

            def score_mod(score, b_, h, q_, kv_):
                return score - torch.exp2(-8.0 * (h + 1).to(torch.float32) / heads) * (q_ - kv_).abs()
        elif self.mode == "alibi_buffer":
            slopes = self.slopes

            def score_mod(score, b_, h, q_, kv_):
                return score - slopes[h] * (q_ - kv_).abs()
        elif self.mode == "softcap":

            def score_mod(score, b_, h, q_, kv_):
                return 20.0 * torch.tanh(score / 20.0)

        out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=kv != heads)
        return self.o(out.transpose(1, 2).reshape(b, s, heads * d))


class FlexBlock(nn.Module):
    def __init__(self, mode: str, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.norm, self.attention = nn.LayerNorm(dim), FlexAttention(mode, dim, heads, kv_heads)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, h, block_mask=None):
        h = h + self.attention(self.norm(h), block_mask)
        return h + self.mlp(h)


class FlexLM(nn.Module):
    """A decoder of FlexAttention blocks (pre-norm, GELU MLP)."""

    def __init__(self, mode: str = "forward_mask", dim: int = 32, heads: int = 4, kv_heads: int = 2, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(FlexBlock(mode, dim, heads, kv_heads) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, ids, block_mask=None):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h, block_mask)
        return self.head(h)


def flex_lm(mode: str = "forward_mask", **config) -> FlexLM:
    torch.manual_seed(0)
    return FlexLM(mode, **config)
