"""The small programs tests/test_ops.py captures: together they use every row of the op table (that test checks
each row is exercised) with op_samples_typed.py's.  ``SAMPLES``: name -> (make the program, make its inputs); float64
weights and inputs."""

from __future__ import annotations

import torch
import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers.grouped_mm_fallback)
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from autotp.runtime.paged_attention import paged_attention

aten = torch.ops.aten
H, FFN, HEADS, KV, D, VOCAB = 12, 24, 6, 2, 2, 16  # 6 query heads and 2 KV heads of 2: uneven and shared at 4 ranks


class Program(nn.Module):
    """``fn(self, *inputs)`` with parameters of the given shapes (their sizes make dims static)."""

    def __init__(self, fn, **shapes):
        super().__init__()
        self.fn = fn
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.randn(*shape, dtype=torch.float64) / 4))

    def forward(self, *inputs):
        return self.fn(self, *inputs)


def pointwise(m, x, y):
    h = x * m.w + y  # mul.Tensor, add.Tensor
    h = aten.sub.Tensor(h, m.w) / (m.w.abs() + 1)
    h = aten.add.Scalar(aten.div.Scalar(aten.mul.Scalar(h, 2.0), 3.0), 1.0)
    h = aten.sub.Scalar(aten.neg.default(aten.clone.default(h)), 0.5)
    h = aten.detach.default(aten.alias.default(aten.contiguous.default(h))) + h
    h = aten.to.dtype(aten._to_copy.default(h, dtype=torch.float32), torch.float64)
    h = aten.to.device(
        aten.to.dtype_layout(h, dtype=torch.float64, layout=torch.strided), torch.device("cpu"), torch.float64
    )
    h = torch.nn.functional.silu(h) + torch.nn.functional.gelu(h) + torch.erf(h) * torch.cos(h) - torch.sin(h)
    h = h + h.pow(2)
    h = torch.tanh(h) + torch.relu(h) + torch.sigmoid(h) * torch.exp(-h.abs()) + torch.rsqrt(h.abs() + 1)
    h = aten.dropout.default(h + torch.sqrt(h.abs()), 0.1, False)
    masks = [op(h, y) for op in (torch.eq, torch.ne, torch.lt, torch.gt, torch.le, torch.ge)]
    masks = [
        m & op(h, 0.5)
        for m, op in zip(masks, (torch.eq, torch.ne, torch.lt, torch.gt, torch.le, torch.ge), strict=True)
    ]
    h = torch.where(masks[3], h, y).masked_fill(masks[2], 0.0).masked_fill(masks[1], torch.tensor(0.25))
    h = h.clamp(-2.0, 2.0) + h.clamp_min(-1.0) + h.clamp_max(1.0) + torch.clamp(h, min=y - 3)
    h = h.square() + torch.nn.functional.softplus(h) + torch.expm1(h / 4) + (1 - h) + torch.zeros_like(h)
    h = torch.minimum(h, y) + torch.maximum(h, y) + torch.min(h, y) + torch.max(h, y) + torch.ones_like(y)
    h = aten.where.ScalarOther(masks[0], h, 0.5)
    g = h.abs() + 1
    h = h + torch.log(g) + torch.log2(g) + torch.log1p(g) + torch.nn.functional.logsigmoid(h) + g.reciprocal()
    h = h + torch.nn.functional.hardtanh(h) + torch.nn.functional.hardsigmoid(h) + torch.nn.functional.hardswish(h)
    h = h + torch.sign(h) + torch.ceil(h) + torch.floor(h) + torch.round(h) + aten.multiply.Tensor(h, y)
    return h * m.w.expand_as(h) + masks[0] + masks[1] + masks[4] + masks[5]


def products(m, x, rows):
    h = torch.nn.functional.linear(x, m.up, m.up_bias)  # linear with a bias (split off, then linear + add)
    h = torch.nn.functional.silu(h) @ m.down.t()  # matmul with a transposed weight
    flat = h.reshape(-1, H)
    h = aten.mm.default(flat, m.proj).view(x.shape[0], -1, H)
    batched = torch.bmm(m.left, m.right)  # [4, 3, 6] @ [4, 6, 12]
    return h + batched.sum(0).sum(0) + aten.mm.default(rows, m.proj).sum(0)  # rows: [tokens, H]


def attention(m, x, mask):
    b, s, _ = x.shape
    q = torch.nn.functional.linear(x, m.q).view(b, s, HEADS, D).transpose(1, 2)
    k = torch.nn.functional.linear(x, m.k).view(b, s, KV, D).transpose(1, 2)
    v = torch.nn.functional.linear(x, m.v).view(b, s, KV, D).transpose(1, 2)
    k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
    fused = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    masked = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    scores = (q @ k.transpose(-2, -1)).softmax(-1)  # matmul, softmax.int
    manual = aten._softmax.default(scores, -1, False) @ v
    out = (fused + masked + manual).transpose(1, 2).reshape(b, s, HEADS * D)
    return torch.nn.functional.linear(out, m.o)


def fused_qkv(m, x):
    b, s, _ = x.shape
    q, k, v = torch.nn.functional.linear(x, m.qkv).split([HEADS * D, KV * D, KV * D], dim=-1)
    q = q.view(b, s, HEADS, D).transpose(1, 2)
    k = k.view(b, s, KV, D).transpose(1, 2).repeat_interleave(HEADS // KV, 1)
    v = v.view(b, s, KV, D).transpose(1, 2).repeat_interleave(HEADS // KV, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1)
    gate, up = torch.nn.functional.linear(out, m.gate_up).chunk(2, dim=-1)
    return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, m.down)


def language_model(m, ids):
    h = torch.nn.functional.embedding(ids, m.table)
    h = torch.nn.functional.layer_norm(h, (H,), m.scale, m.shift)
    rms = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) + h.sum(-1, keepdim=True)
    logits = torch.nn.functional.linear(rms, m.table)  # tied to the embedding
    return logits.log_softmax(-1) + aten._log_softmax.default(logits, -1, False)


def layouts(m, x):
    b, s, _ = x.shape
    h = x * m.w
    heads = aten._unsafe_view.default(h, [b, s, 3, 4]).permute(0, 2, 1, 3).transpose(-1, -2)
    h = h + heads.transpose(-1, -2).permute(0, 2, 1, 3).reshape(b, s, H)
    h = h + torch.flatten(h.unsqueeze(-1), 2) + aten.broadcast_to.default(m.w, [b, s, H])
    h = h + m.w.unsqueeze(0).expand(s, H) + aten.numpy_T.default(m.square).t()[0]
    pieces = h.split([4, 8], dim=-1)
    rows = torch.cat([pieces[1], pieces[0]], dim=-1) + torch.stack(h.chunk(2, -1), -1).flatten(-2)
    rows = rows + torch.cat(h.split(6, dim=-1), -1)
    rows = rows + torch.cat([torch.empty(0), h], dim=1)  # a 1-D empty part, which cat skips (XLM's cache)
    return rows[:, :, 2:10].sum(-1) + h.select(-1, 3) + h.unsqueeze(2).squeeze(2)[..., 0]


def constant_cuts(m, x):
    """Falcon-style heads cut by constant positions: a run (a slice) and positions that are no run."""
    b, s, _ = x.shape
    heads = torch.nn.functional.linear(x, m.qkv).view(b, s, 4, D)  # [query | query | key | value]
    q = heads[:, :, :-2]
    k = heads[:, :, [-2]]
    odd = heads[:, :, torch.tensor([0, 2, 3])]
    return (q * k).sum(-1).sum(-1) + odd.sum(-1).sum(-1)


def packed_attention(m, x):
    """nn.MultiheadAttention's layouts: q|k|v packed in one weight and picked apart (unflatten, dim moves, select),
    heads merged with the batch and viewed back; cross-attention's weight split into [q | k|v]; heads by unflatten."""
    b, s, _ = x.shape
    packed = torch.nn.functional.linear(x, m.packed).unflatten(-1, (3, HEADS * D)).unsqueeze(0).transpose(0, -2)
    packed = packed.squeeze(-2).contiguous()
    q, k, v = (packed[i].view(b, s * HEADS, D).transpose(0, 1).view(s, HEADS, b, D) for i in range(3))
    w_q, w_kv = m.cross.split_with_sizes([HEADS * D, 2 * HEADS * D])
    ck, cv = torch.nn.functional.linear(x, w_kv).split(HEADS * D, dim=-1)
    cq = torch.nn.functional.linear(x, w_q).unflatten(-1, (HEADS, D))
    return (q * k + v).sum(0).sum(-1).sum(-1) + (cq * ck.unflatten(-1, (HEADS, D)) + cv.view(b, s, HEADS, D)).sum(-1)


def flex(m, x):
    """FlexAttention with grouped KV heads, a score function of the head index and a block mask built here."""
    b, s, _ = x.shape
    q = torch.nn.functional.linear(x, m.q).view(b, s, HEADS, D).transpose(1, 2)
    k, v = (torch.nn.functional.linear(x, w).view(b, s, KV, D).transpose(1, 2) for w in (m.k, m.v))

    def score(value, batch, head, query, key):
        return value - (head + 1) * 0.1 * (query - key).abs()

    mask = create_block_mask(lambda batch, head, query, key: query >= key, None, None, s, s, device=x.device)
    return flex_attention(q, k, v, score_mod=score, block_mask=mask, enable_gqa=True)


def paged(m, x, table, positions):
    """Attention reading a paged pool of grouped KV heads in place through a block table (serving's steps)."""
    b, s, _ = x.shape
    q = torch.nn.functional.linear(x, m.q).view(b, s, HEADS, D).transpose(1, 2)
    return paged_attention(q, m.keys * 2, m.values, table, positions, 2, D**-0.5, 3, 0.0).sum(-1)


def experts(m, x, ids):
    """Routed rows: each token's expert weight by lookup (then bmm), and a grouped matmul over rows sorted by
    expert (transformers' export-friendly twin of torch's, which wants bf16 and 16-byte rows)."""
    looked_up = torch.bmm(x.unsqueeze(1), m.w[ids]).squeeze(1)  # [T, 1, H] @ [T, H, 8]
    offs = torch.tensor([3, 5, 8], dtype=torch.int32)
    grouped = torch.ops.transformers.grouped_mm_fallback(x, m.w, offs)
    return torch.nn.functional.silu(looked_up) + grouped


def _floats(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def scans(m, x):
    """Padding to a multiple of a chunk and scanning within it (state-space layers), then a scan over hidden."""
    h = torch.nn.functional.pad(x * m.w, (0, 0, 0, (4 - x.shape[1] % 4) % 4))  # pad.default, a computed width
    h = aten.constant_pad_nd.default(h.cumsum(1), [0, 0, 1, 0], 0.5)
    values, indices = h.topk(3, dim=1)
    return h.cumsum(-1)[:, : x.shape[1]] + values.sum(1, keepdim=True) + indices.sum()


def einsums(m, x):
    """Attention written as einsums (einops-style libraries), a contraction with a weight, rotary's unbind, KV
    heads repeated tiled (x-transformers' ``'b kvh n d -> b (r kvh) n d'``: query head i reads KV head i % KV)."""
    b, s, _ = x.shape
    q = torch.einsum("bnd,ed->bne", x, m.q).view(b, s, HEADS, D).transpose(1, 2)
    k = torch.nn.functional.linear(x, m.k).view(b, s, HEADS, D).transpose(1, 2)
    x1, x2 = q.reshape(b, HEADS, s, D // 2, 2).unbind(-1)
    q = torch.stack((-x2, x1), -1).reshape(b, HEADS, s, D) + q
    weights = torch.einsum("bhid,bhjd->bhij", q, k).softmax(-1)
    v = torch.nn.functional.linear(x, m.v).view(b, s, KV, D).transpose(1, 2)
    v = v.unsqueeze(1).expand(b, HEADS // KV, KV, s, D).reshape(b, HEADS, s, D)
    out = torch.einsum("bhij,bhjd->bhid", weights, v)
    return torch.einsum("bhsd,ehd->bse", out, m.o.view(H, HEADS, D))


def convolutions(m, x, image):
    """A 1-D conv over the sequence (channels first), a depthwise one with a bias (state-space layers), a 2-D
    patch embedding (and one padded "same"), and an eval-mode batch norm of it."""
    h = torch.nn.functional.conv1d(x.transpose(1, 2), m.mix, padding=1)
    h = torch.nn.functional.conv1d(h, m.depthwise, m.depthwise_bias, padding=2, groups=FFN)
    patches = torch.nn.functional.conv2d(image, m.patch, m.patch_bias, stride=2)
    patches = patches + torch.nn.functional.conv2d(image, m.patch, padding="same")[..., ::2, ::2]
    stats = m.bn_mean.detach(), (m.bn_var.square() + 0.5).detach()  # running statistics: no gradient
    patches = torch.nn.functional.batch_norm(patches, *stats, m.bn_w, m.bn_b)
    return h.transpose(1, 2)[:, : x.shape[1]].sum(-1) + patches.flatten(2).sum((1, 2)).unsqueeze(-1)


def channels(m, image, x):
    """A weight-normed conv (wav2vec2's positional conv), a gate over channels (conformers), a flip, pooling and
    resampling of the image and of a signal, an acos, windows by im2col (ConvBERT's span convolution): batch and
    channels pass through each."""
    h = torch.nn.functional.conv2d(image, torch._weight_norm(m.v, m.g, 0))  # [2, H, 3, 3]
    h = torch.nn.functional.glu(torch.cat([h, h.flip([2, 3])], 3), dim=3) + torch.acos(torch.tanh(h) / 2)
    pooled = torch.nn.functional.avg_pool2d(h, 2, stride=1).sum((2, 3)) + torch.nn.functional.adaptive_avg_pool2d(
        h, 1
    ).flatten(1)
    pooled = pooled + torch.nn.functional.unfold(h, (2, 1), padding=(1, 0)).sum(-1).unflatten(1, (H, 2)).sum(-1)
    for mode in ("nearest", "bilinear", "bicubic"):
        pooled = pooled + torch.nn.functional.interpolate(h, size=(4, 5), mode=mode).sum((2, 3))
    signal = x.transpose(1, 2) * pooled.unsqueeze(-1)  # [2, H, 5]
    for mode in ("nearest", "linear"):
        signal = signal + torch.nn.functional.interpolate(signal, size=7, mode=mode)[..., :5]
    signal = torch.nn.functional.avg_pool1d(signal, 2, stride=1, padding=1)[..., :5]
    return signal + torch.nn.functional.adaptive_avg_pool1d(signal, 1)


def selections(m, x, ids):
    """Reductions that are no sums (max, logsumexp, a vector norm), picks along a dim (relative positions read
    with gather, a router's weights written with scatter), repeats, a causal mask's tril and a concat."""
    h = x * m.w  # [2, 5, H]
    values, where = h.max(-1, keepdim=True)
    low, _ = h.min(1)
    h = (
        h
        - values
        + torch.amax(h, 1, keepdim=True)
        + torch.amin(h, (0, 1))
        + torch.logsumexp(h, 1, keepdim=True)
        + torch.linalg.vector_norm(h, dim=-1, keepdim=True)
        + where
        + low.unsqueeze(1)
        + h.argmax(1, keepdim=True)
        + h.argmin(-1, keepdim=True)
    )
    picked = torch.gather(h, 2, ids) + h.scatter(2, ids, 0.5)[..., :3] + h.scatter(2, ids, h[..., 3:6])[..., :3]
    h = h + torch.nn.functional.rms_norm(h, (H,), m.w, 1e-6)
    heads = h.view(2, 5, HEADS, D).transpose(1, 2)
    scores = ((heads @ heads.transpose(2, 3)).tril() + (heads @ heads.transpose(2, 3)).triu(1)).sum(1)  # [2, 5, 5]
    tiled = h.repeat(1, 2, 1)[:, :5] + h.repeat(2, 1, 1, 1).sum(0)
    return torch.concat([picked, scores, tiled], -1)


def written(m, x):
    """Rows of a per-head buffer written in place through a view (a chunked linear attention's output filled chunk
    by chunk): ``copy_`` into a slice of a tensor split by heads."""
    h = (x * m.w).view(2, 5, HEADS, D).transpose(1, 2).contiguous()  # [2, HEADS, 5, D]
    out = torch.zeros_like(h)
    out[:, :, 1:3] = h[:, :, 1:3] * 2
    out[:, :, 4] = 0.5
    return out + h


def conformer(m, x):
    """A conformer's convolution module: a pointwise conv to two gated halves (glu over the channels), a depthwise
    conv, a batch norm, and a pointwise conv back, each with a bias."""
    h = torch.nn.functional.conv1d(x.transpose(1, 2), m.pw1, m.pw1_bias)  # [2, 2 * FFN, 5]
    h = torch.nn.functional.glu(h, dim=1)
    h = torch.nn.functional.conv1d(h, m.dw, m.dw_bias, padding="same", groups=FFN)
    h = torch.nn.functional.batch_norm(h, m.bn_mean.detach(), (m.bn_var.square() + 0.5).detach(), m.bn_w, m.bn_b)
    h = torch.nn.functional.conv1d(torch.nn.functional.silu(h), m.pw2, m.pw2_bias)
    return x + h.transpose(1, 2)


def linear_mixer(m, x):
    """A linear-attention layer's pieces: q, k, v cut from one projection, concatenated again for a depthwise short
    conv and cut apart; new tensors of a given size (a state begun with ``new_zeros``, a buffer by ``new_empty``
    filled whole); windows by ``unfold``; a score matrix begun from zeros by ``baddbmm``."""
    q, k, v = (x @ m.qkv.t()).split(H, -1)  # [2, 5, H] each
    mixed = torch.nn.functional.conv1d(torch.cat([q, k, v], -1).transpose(1, 2), m.dw, groups=3 * H, padding=1)
    q, k, v = (t.reshape(2, 5, HEADS, D) for t in mixed.transpose(1, 2).split(H, -1))
    state = q.new_zeros(2, 5, HEADS, D) + k.new_ones(2, 5, HEADS, D) + v.new_full((2, 5, HEADS, D), 0.5)
    buffer = q.new_empty(2, 5, HEADS, D)
    buffer.copy_(v)
    windows = k.unfold(1, 2, 1).sum(-1)  # [2, 4, HEADS, D]
    heads = q.transpose(1, 2).reshape(2 * HEADS, 5, D)
    scores = torch.baddbmm(heads.new_zeros(2 * HEADS, 5, 5), heads, heads.transpose(1, 2), alpha=0.5)
    return (q * state + buffer)[:, :4] + windows + scores.view(2, HEADS, 5, 5).transpose(1, 2)[:, :4, :, :D]


SAMPLES = {
    "pointwise": (lambda: Program(pointwise, w=(H,)), lambda: (_floats(2, 5, H), _floats(2, 5, H))),
    "products": (
        lambda: Program(
            products, up=(FFN, H), up_bias=(FFN,), down=(H, FFN), proj=(H, H), left=(4, 3, 6), right=(4, 6, H)
        ),
        lambda: (_floats(2, 5, H), _floats(7, H)),
    ),
    "attention": (
        lambda: Program(attention, q=(HEADS * D, H), k=(KV * D, H), v=(KV * D, H), o=(H, HEADS * D)),
        lambda: (_floats(2, 5, H), _floats(2, HEADS, 5, 5)),
    ),
    "fused_qkv": (
        lambda: Program(fused_qkv, qkv=((HEADS + 2 * KV) * D, H), gate_up=(2 * FFN, HEADS * D), down=(H, FFN)),
        lambda: (_floats(2, 5, H),),
    ),
    "language_model": (
        lambda: Program(language_model, table=(VOCAB, H), scale=(H,), shift=(H,)),
        lambda: (torch.randint(0, VOCAB, (2, 5)),),
    ),
    "layouts": (lambda: Program(layouts, w=(H,), square=(H, H)), lambda: (_floats(2, 5, H),)),
    "constant_cuts": (lambda: Program(constant_cuts, qkv=(4 * D, H)), lambda: (_floats(2, 5, H),)),
    "flex": (lambda: Program(flex, q=(HEADS * D, H), k=(KV * D, H), v=(KV * D, H)), lambda: (_floats(2, 5, H),)),
    "packed_attention": (
        lambda: Program(packed_attention, packed=(3 * HEADS * D, H), cross=(3 * HEADS * D, H)),
        lambda: (_floats(2, 5, H),),
    ),
    "einsums": (
        lambda: Program(einsums, q=(HEADS * D, H), k=(HEADS * D, H), v=(KV * D, H), o=(H, HEADS * D)),
        lambda: (_floats(2, 5, H),),
    ),
    "convolutions": (
        lambda: Program(
            convolutions,
            mix=(FFN, H, 3),
            depthwise=(FFN, 1, 5),
            depthwise_bias=(FFN,),
            patch=(H, 3, 2, 2),
            patch_bias=(H,),
            bn_mean=(H,),
            bn_var=(H,),
            bn_w=(H,),
            bn_b=(H,),
        ),
        lambda: (_floats(2, 5, H), _floats(2, 3, 4, 4)),
    ),
    "scans": (lambda: Program(scans, w=(H,)), lambda: (_floats(2, 5, H),)),
    "channels": (
        lambda: Program(channels, v=(H, 3, 2, 2), g=(H, 1, 1, 1)),
        lambda: (_floats(2, 3, 4, 4), _floats(2, 5, H)),
    ),
    "selections": (lambda: Program(selections, w=(H,)), lambda: (_floats(2, 5, H), torch.randint(0, H, (2, 5, 3)))),
    "written": (lambda: Program(written, w=(H,)), lambda: (_floats(2, 5, H),)),
    "linear_mixer": (lambda: Program(linear_mixer, qkv=(3 * H, H), dw=(3 * H, 1, 3)), lambda: (_floats(2, 5, H),)),
    "conformer": (
        lambda: Program(
            conformer,
            pw1=(2 * FFN, H, 1),
            pw1_bias=(2 * FFN,),
            dw=(FFN, 1, 3),
            dw_bias=(FFN,),
            bn_mean=(FFN,),
            bn_var=(FFN,),
            bn_w=(FFN,),
            bn_b=(FFN,),
            pw2=(H, FFN, 1),
            pw2_bias=(H,),
        ),
        lambda: (_floats(2, 5, H),),
    ),
    "paged": (
        lambda: Program(paged, q=(HEADS * D, H), keys=(16, KV, D), values=(16, KV, D)),
        lambda: (_floats(2, 5, H), torch.tensor([[0, 3, 5], [7, 2, 1]]), torch.arange(1, 6).repeat(2, 1)),
    ),
    "experts": (lambda: Program(experts, w=(3, H, 8)), lambda: (_floats(8, H), torch.tensor([0, 0, 0, 1, 1, 2, 2, 2]))),
}
