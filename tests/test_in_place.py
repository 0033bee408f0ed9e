"""In-place ops on new tensors are prepared as their out-of-place twins (canonicalize/in_place_ops.py).  DeBERTa
and SEW-D zero masked scores with ``softmax(...).masked_fill_(mask, 0)`` inside a custom autograd Function; the
captured graph holds the plain ops, and autograd refuses the write into softmax's saved output.  A write that a
view shares, or into an input, stays.  No ranks: the prepared graph, and its backward."""

from __future__ import annotations

import torch
from torch import nn

from autotp.passes.prepared_graph import prepared_graph
from tests.helpers.exact import TOL

HEADS, HEAD_DIM, DIM = 4, 8, 32


class MaskedSoftmax(torch.autograd.Function):
    """DeBERTa's XSoftmax: the write is fine in eager (its own backward), not in the captured plain ops."""

    @staticmethod
    def forward(ctx, scores, mask):
        probs = torch.softmax(scores.masked_fill(~mask, -1e4), dim=-1)
        probs.masked_fill_(~mask, 0)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, grad):
        (probs,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad, probs, -1, probs.dtype), None


class MaskedScores(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(DIM, 3 * HEADS * HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, h, mask):
        b, s, _ = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        probs = MaskedSoftmax.apply(q @ k.transpose(2, 3), mask)
        return self.o((probs @ v).transpose(1, 2).reshape(b, s, -1))


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_a_write_into_a_saved_softmax_output_is_prepared_out_of_place_and_trains():
    model, h = MaskedScores(), torch.randn(2, 6, DIM)
    mask = torch.rand(2, 1, 6, 6) > 0.3
    gm = prepared_graph(model, (h, mask))
    assert torch.ops.aten.masked_fill_.Scalar not in _targets(gm)
    gm(h, mask).square().mean().backward()  # autograd refused the in-place write here
    model(h, mask).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), gm.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, **TOL, msg=name)


class WriteThroughView(nn.Module):
    def forward(self, x):
        y = x * 2
        y[:, :1].mul_(3)  # the write lands in y through a view: y's readers must see it
        y.add_(1)
        return y


def test_a_write_a_view_shares_is_kept():
    x = torch.randn(3, 4)
    gm = prepared_graph(WriteThroughView(), (x,))
    assert torch.ops.aten.add_.Tensor in _targets(gm)
    torch.testing.assert_close(gm(x), WriteThroughView()(x))


class WriteIntoUnreadView(nn.Module):
    """Funnel's ``positional_attn = positional_attn[..., :n]; positional_attn *= cls_mask``: the base is read by the
    view alone and the view by the write alone, so nothing but the write's result sees it."""

    def forward(self, x, mask):
        scores = (x * 2)[..., :3]
        scores *= mask
        return scores


def test_a_write_into_a_view_nothing_else_reads_is_prepared_out_of_place():
    x, mask = torch.randn(3, 5, requires_grad=True), torch.rand(3, 3)
    gm = prepared_graph(WriteIntoUnreadView(), (x, mask))
    assert torch.ops.aten.mul_.Tensor not in _targets(gm) and torch.ops.aten.mul.Tensor in _targets(gm)
    torch.testing.assert_close(gm(x, mask), WriteIntoUnreadView()(x, mask))
