"""The other libraries' models of the coverage sweep (the ``sweep`` extra), built at the sweep's shrunk sizes."""

from __future__ import annotations

import torch
from coverage_models import BATCH, HEAD_DIM, HEADS, HIDDEN, SEQ, VOCAB


def _x_decoder():
    from x_transformers import Decoder, TransformerWrapper

    model = TransformerWrapper(
        num_tokens=VOCAB,
        max_seq_len=64,
        attn_layers=Decoder(
            dim=HIDDEN, depth=2, heads=HEADS, attn_kv_heads=2, rotary_pos_emb=True, attn_dim_head=HEAD_DIM
        ),
    )
    return model, {"x": torch.randint(0, VOCAB, (BATCH, SEQ))}


def _x_encoder():
    from x_transformers import Encoder, TransformerWrapper

    model = TransformerWrapper(
        num_tokens=VOCAB,
        max_seq_len=64,
        attn_layers=Encoder(dim=HIDDEN, depth=2, heads=HEADS, attn_dim_head=HEAD_DIM, ff_glu=True),
    )
    return model, {"x": torch.randint(0, VOCAB, (BATCH, SEQ))}


def _x_vit():
    from x_transformers import Encoder, ViTransformerWrapper

    model = ViTransformerWrapper(
        image_size=32,
        patch_size=8,
        num_classes=10,
        attn_layers=Encoder(dim=HIDDEN, depth=2, heads=HEADS, attn_dim_head=HEAD_DIM),
    )
    return model, {"img": torch.randn(BATCH, 3, 32, 32)}


def _x_encoder_decoder():
    from x_transformers import XTransformer

    model = XTransformer(
        dim=HIDDEN,
        enc_num_tokens=VOCAB,
        enc_depth=2,
        enc_heads=HEADS,
        enc_max_seq_len=64,
        dec_num_tokens=VOCAB,
        dec_depth=2,
        dec_heads=HEADS,
        dec_max_seq_len=64,
    )
    return model, {"src": torch.randint(0, VOCAB, (BATCH, SEQ)), "tgt": torch.randint(0, VOCAB, (BATCH, SEQ))}


def _mixer():
    from mlp_mixer_pytorch import MLPMixer

    model = MLPMixer(image_size=32, channels=3, patch_size=8, dim=HIDDEN, depth=2, num_classes=10)
    return model, {"input": torch.randn(BATCH, 3, 32, 32)}


def _perceiver():
    from perceiver_pytorch import Perceiver

    model = Perceiver(
        num_freq_bands=4,
        depth=2,
        max_freq=10.0,
        input_channels=3,
        input_axis=2,
        num_latents=16,
        latent_dim=HIDDEN,
        cross_heads=1,
        latent_heads=HEADS,
        cross_dim_head=HEAD_DIM,
        latent_dim_head=HEAD_DIM,
        num_classes=10,
    )
    return model, {"data": torch.randn(BATCH, 16, 16, 3)}


def _gateloop():
    from gateloop_transformer import Transformer

    model = Transformer(
        dim=HIDDEN, num_tokens=VOCAB, depth=2, dim_head=HEAD_DIM, heads=HEADS, checkpoint_gate_looped_attn=False
    )
    return model, {"x": torch.randint(0, VOCAB, (BATCH, SEQ))}


OTHERS = {
    "x-transformers:decoder": _x_decoder,
    "x-transformers:encoder": _x_encoder,
    "x-transformers:vit": _x_vit,
    "x-transformers:encoder-decoder": _x_encoder_decoder,
    "mlp-mixer-pytorch:mixer": _mixer,
    "perceiver-pytorch:perceiver": _perceiver,
    "gateloop-transformer:transformer": _gateloop,
}
