"""Every transformers config the tests build, made here and nowhere else (tests/test_helpers.py checks it).

One function per family, returning its config: a tiny one (toy sizes, no KV cache) with ``overrides`` applied
over the defaults, so a test names only what it changes.  A test that means transformers' own value of a default
set here (``use_cache=True``, a longer position table) passes it.  ``mixtral_8x7b`` and ``deepseek_v3_671b`` are
transformers' defaults for their families, which are those published models' shapes.  ``ARCHITECTURES``: the
layouts tests/test_architectures.py runs (``architecture(name)``)."""

from __future__ import annotations

# Tables of sizes, a few lines a config as transformers spells its fields: left as written.
# fmt: off

# the sizes tests/test_layouts.py and the architectures' table share
SMALL = {"vocab_size": 96, "max_position_embeddings": 64}


def llama(**overrides):
    """LLaMA: 2 blocks of 64, 4 heads sharing 2 KV heads, FFN 96."""
    from transformers import LlamaConfig
    return LlamaConfig(**{"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
                          "use_cache": False, **overrides})


def llama_1gb(**overrides):
    """A LLaMA of 1.35 GB of fp32 weights: 4 blocks of 2048, 16 heads, FFN 5632, vocabulary 32000."""
    return llama(**{"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 4,
                    "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 2048,
                    **overrides})


def phi3(**overrides):
    """Phi-3: fused qkv (8 heads, 2 KV heads) and gate_up projections, 2 blocks of 64, FFN 96."""
    from transformers import Phi3Config
    return Phi3Config(**{"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                         "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 64,
                         "use_cache": False, **overrides})


def phi(**overrides):
    """Phi-2: one layer norm feeding attention and MLP in parallel, 2 blocks of 64, 4 heads, FFN 96."""
    from transformers import PhiConfig
    return PhiConfig(**{"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "max_position_embeddings": 64, "use_cache": False, **overrides})


def gpt2(**overrides):
    """GPT-2: 2 blocks of 64, 4 heads, 64 positions."""
    from transformers import GPT2Config
    return GPT2Config(**{"vocab_size": 96, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
                         "use_cache": False, **overrides})


def gpt_bigcode(**overrides):
    """StarCoder's GPT-BigCode: multi-query, fused c_attn, 2 blocks of 64, 8 heads, no dropout."""
    from transformers import GPTBigCodeConfig
    return GPTBigCodeConfig(**{"vocab_size": 96, "n_embd": 64, "n_layer": 2, "n_head": 8, "multi_query": True,
                               "n_positions": 64, "use_cache": False, "bos_token_id": 0, "eos_token_id": 0,
                               "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, **overrides})


def gptj(**overrides):
    """GPT-J: rotary on interleaved pairs of 4 dims, 2 blocks of 64, 8 heads, no dropout."""
    from transformers import GPTJConfig
    return GPTJConfig(**{"vocab_size": 96, "n_embd": 64, "n_layer": 2, "n_head": 8, "rotary_dim": 4,
                         "n_positions": 64, "use_cache": False, "attn_pdrop": 0.0, "resid_pdrop": 0.0,
                         "embd_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0, **overrides})


def gpt_neox(**overrides):
    """GPT-NeoX: qkv packed per head, 2 blocks of 64, 4 heads, FFN 96."""
    from transformers import GPTNeoXConfig
    return GPTNeoXConfig(**{"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "max_position_embeddings": 64, "use_cache": False,
                            **overrides})


def falcon(**overrides):
    """Falcon without ALiBi or dropout: 2 blocks of 64, 8 heads (the head layout is each test's)."""
    from transformers import FalconConfig
    return FalconConfig(**{"vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
                           "alibi": False, "max_position_embeddings": 64, "use_cache": False,
                           "attention_dropout": 0.0, "hidden_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 0,
                           "pad_token_id": 0, **overrides})


def bloom(**overrides):
    """BLOOM (ALiBi): 2 blocks of 32, 4 heads."""
    from transformers import BloomConfig
    return BloomConfig(**{"hidden_size": 32, "n_layer": 2, "n_head": 4, **SMALL, "use_cache": False, **overrides})


def olmo2(**overrides):
    """OLMo-2 (norms after attention and MLP, q/k norms): 2 blocks of 64, 4 heads, FFN 96."""
    from transformers import Olmo2Config
    return Olmo2Config(**{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 4, "intermediate_size": 96, **SMALL, "use_cache": False,
                          **overrides})


def mamba2(**overrides):
    """Mamba-2: 2 state-space blocks of 64, 4 heads of 32, chunks of 8 (the sequence is padded to a multiple)."""
    from transformers import Mamba2Config
    return Mamba2Config(**{"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 4,
                           "head_dim": 32, "n_groups": 1, "state_size": 16, "chunk_size": 8, "expand": 2,
                           "use_cache": False, **overrides})


def bamba(**overrides):
    """Bamba: a hybrid of Mamba-2 blocks (4 heads of 16, chunks of 8) and attention (block 1: 4 heads sharing 2
    KV heads), hidden 64, FFN 96."""
    from transformers import BambaConfig
    return BambaConfig(**{"vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "attn_layer_indices": [1],
                          "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_n_groups": 1, "mamba_d_state": 16,
                          "mamba_chunk_size": 8, "mamba_expand": 2, "max_position_embeddings": 64,
                          "use_cache": False, **overrides})


def vit(**overrides):
    """A ViT classifier of 16 x 16 images in 4 x 4 patches (17 tokens), 2 blocks of 64, 4 heads, 5 labels."""
    from transformers import ViTConfig
    return ViTConfig(**{"image_size": 16, "patch_size": 4, "num_channels": 3, "hidden_size": 64,
                        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_labels": 5,
                        **overrides})


def mixtral(**overrides):
    """Mixtral: 2 blocks of 32, 4 heads sharing 2 KV heads, 4 experts of 48 (top 2)."""
    from transformers import MixtralConfig
    return MixtralConfig(**{"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
                            "num_experts_per_tok": 2, "max_position_embeddings": 64, "use_cache": False,
                            **overrides})


def mixtral_8x7b(**overrides):
    """transformers' Mixtral defaults, Mixtral-8x7B's shape: 32 blocks of 4096, 32 heads sharing 8 KV heads,
    8 experts of 14336 (top 2), vocabulary 32000."""
    from transformers import MixtralConfig
    return MixtralConfig(**overrides)


def qwen3_moe(**overrides):
    """Qwen3-MoE: 2 blocks of 32, 4 heads of 8 sharing 2 KV heads, 8 experts of 32 (top 2)."""
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(**{"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
                             "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                             "num_key_value_heads": 2, "head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2,
                             "max_position_embeddings": 64, "use_cache": False, **overrides})


def qwen2_moe(**overrides):
    """Qwen2-MoE: 4 routed experts of 32 (top 2) beside a shared expert of 48, 2 blocks of 32."""
    from transformers import Qwen2MoeConfig
    return Qwen2MoeConfig(**{"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
                             "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "num_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64,
                             "use_cache": False, **overrides})


def deepseek_v3(**overrides):
    """DeepSeek-V3 at toy size: MLA attention (q rank 16, kv rank 8), the first block dense, then 8 routed experts
    of 16 beside one shared expert, top 2 of 4 groups of which each token may use 2; 2 blocks of 32."""
    from transformers import DeepseekV3Config
    return DeepseekV3Config(**{"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
                               "moe_intermediate_size": 16, "num_hidden_layers": 2, "first_k_dense_replace": 1,
                               "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
                               "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
                               "q_lora_rank": 16, "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8,
                               "v_head_dim": 8, "max_position_embeddings": 64, "use_cache": False, **overrides})


def deepseek_v3_671b(**overrides):
    """transformers' DeepSeek-V3 defaults, the published model's shape: 671B parameters."""
    from transformers import DeepseekV3Config
    return DeepseekV3Config(**overrides)



def convbert(**overrides):
    """ConvBERT: 4 heads of 8 (head ratio 2: 2 self-attention heads beside 2 span-convolution heads, kernel 3),
    2 blocks of 32, FFN 64, no dropout."""
    from transformers import ConvBertConfig
    return ConvBertConfig(**{"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                             "intermediate_size": 64, "embedding_size": 32, "conv_kernel_size": 3, "head_ratio": 2,
                             "max_position_embeddings": 64, "hidden_dropout_prob": 0.0,
                             "attention_probs_dropout_prob": 0.0, **overrides})


def t5(**overrides):
    """T5: an encoder-decoder, 2 blocks each side of 32, 4 heads of 8, FFN 64."""
    from transformers import T5Config

    return T5Config(
        **{"vocab_size": 96, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4, **overrides}
    )


def diffllama(**overrides):
    """DiffLlama: differential attention over 4 heads of 8 (as many KV heads), 2 blocks of 32, FFN 64."""
    from transformers import DiffLlamaConfig
    return DiffLlamaConfig(**{"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64,
                              "use_cache": False, **overrides})

# name: (config class, model class, config) -- the layouts tests/test_architectures.py runs, at toy sizes
ARCHITECTURES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {  # sliding window, GQA
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "sliding_window": 4}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {  # biases on q/k/v
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {  # multi-query, scaled embeddings, tied head
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 16}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {  # qkv interleaved per head, partial rotary, parallel
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "rotary_pct": 0.5}),
    "opt": ("OPTConfig", "OPTForCausalLM", {  # learned positions
        "hidden_size": 64, "ffn_dim": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "word_embed_proj_dim": 64}),
    "falcon": ("FalconConfig", "FalconForCausalLM", {  # multi-query fused qkv, parallel attention + MLP
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "new_decoder_architecture": False,
        "multi_query": True, "parallel_attn": True, "alibi": False}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {  # biases, GQA, layer norm
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {  # non-parametric layer norm
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4}),
    "bert": ("BertConfig", "BertModel", {  # encoder, bidirectional
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4}),
}


def architecture(name: str, **overrides):
    """The config of ``ARCHITECTURES[name]`` with ``overrides``; the decoders without a KV cache."""
    import transformers
    config_cls, _, config = ARCHITECTURES[name]
    extra = {} if name == "bert" else {"use_cache": False}
    return getattr(transformers, config_cls)(**{**config, **overrides}, **SMALL, **extra)


def by_layer_type(config_cls: str):
    """A current transformers config (Gemma3TextConfig, ModernBertConfig) whose layers alternate sliding-window
    and full attention, each type with its own rotary table and mask, made in the order of
    ``set(config.layer_types)`` (strings: an order the hash seed picks)."""
    import transformers
    return getattr(transformers, config_cls)(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=100, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        use_cache=False, pad_token_id=0)


def paligemma():
    """A PaliGemma of a 2-block Gemma (4 heads sharing 2 KV heads) and a 1-block SigLIP, token 127 the image's."""
    from transformers import GemmaConfig, PaliGemmaConfig, SiglipVisionConfig
    text = GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=128, use_cache=False)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=16)
    return PaliGemmaConfig(text_config=text, vision_config=vision, image_token_index=127)
