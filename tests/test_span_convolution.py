"""ConvBERT (transformers, random weights): self-attention heads beside span-convolution heads.  The convolution's
kernels are viewed from [b, s, heads * k] as [b * s * heads, k, 1] and its windows (im2col) from [b, s, heads * d,
k] as [b * s * heads, d, k], softmaxed over k and multiplied row by row (canonicalize/flattened_rows.py keeps the rows
apart: heads stay a dim); the two kinds of heads are joined before the output projection (passes/hints.join_hints).
Both softmaxes split by heads, exact in training at 2 ranks."""

from __future__ import annotations

import torch
from transformers import ConvBertForMaskedLM

import autotp
from tests.helpers.configs import convbert
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import same_as_model

VOCAB = 100


def _model() -> ConvBertForMaskedLM:
    torch.manual_seed(0)
    return ConvBertForMaskedLM(convbert(vocab_size=VOCAB)).train()


def _inputs(batch: int, seq: int) -> tuple:
    return (torch.randint(0, VOCAB, (batch, seq)),)


def _run(rank: int, world: int) -> None:
    model = _model()
    sharded = autotp.parallelize(model, _inputs(2, 6))
    plan = sharded.autotp_plan
    assert plan.replicated_ops == [], plan.replicated_ops
    softmaxes = {k: v["out"] for k, v in plan.nodes.items() if v.get("op") == "aten.softmax.int"}
    assert len(softmaxes) == 4 and all(out.startswith("S(") for out in softmaxes.values()), softmaxes
    assert plan.params["convbert.encoder.layer.0.attention.output.dense.weight"] == "S(1|16,16)", plan.params
    same_as_model(model, sharded, lambda batch, seq: _inputs(batch, seq))


def test_self_attention_and_span_convolution_heads_split_exact():
    run_ranks(2, _run)
