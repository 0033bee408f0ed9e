"""The models of the coverage sweep (benchmarks/coverage_sweep.py): every architecture of the installed transformers,
built from its own config class shrunk by one generic rule (a few models of other libraries: coverage_library.py).

``shrink(config_dict)`` walks a config's fields by name, nested sub-configs included: hidden sizes to 64, intermediate
sizes scaled with them, 2 layers, vocabularies to 1000 (special token ids moved inside), 4 heads (2 KV heads where
there were fewer KV heads than heads, 1 where there was 1), head dims 16, 4 experts, top-k at most 2, images of a
few patches, audio of a few frames.  Nothing is keyed on a model's name: a field's name and value decide.
``inputs(model, config)`` makes batch-2 inputs from the model's ``main_input_name`` and its config's fields.
"""

from __future__ import annotations

import inspect
import math
import re
import zlib

import torch

HIDDEN, HEADS, HEAD_DIM, EXPERTS, VOCAB, BATCH, SEQ = 64, 4, 16, 4, 1000, 2, 8

_HIDDEN = re.compile(
    r"(^|_)(hidden_size|d_model|n_embd|n_embed|embed_dim|hidden_dim|d_embed|emb_dim|model_dim|"
    r"embedding_size|embedding_dim|dim|projection_dim|proj_dim|word_embed_proj_dim)$"
)
_INTER = re.compile(r"(intermediate|ffn|inner|d_ff|dff|dim_ff|dim_feedforward|feed_forward|mlp_dim|ff_dim|ffn_hidden)")
_LAYERS = re.compile(r"(^|_)(layers?|n_layer|depth|blocks)$")
_KV = re.compile(r"(key_value_heads|kv_heads|multi_query_group_num|num_query_groups)$")
_HEADS = re.compile(r"(^|_)(heads?|n_head|num_heads|attention_heads)$")
_EXPERTS = re.compile(
    r"^(num_experts|num_local_experts|n_routed_experts|moe_num_experts|num_routed_experts|"
    r"n_experts)$"
)
_TOPK = re.compile(
    r"^(num_experts_per_tok|num_experts_per_token|top_k|topk|moe_topk|moe_k|router_topk|"
    r"experts_per_token|num_selected_experts)$"
)
_TOKEN = re.compile(r"_(token_id|token_index|token_ids|id)$")
_LIST_WIDTH = re.compile(r"(hidden_sizes|embed_dims|dims|channels|conv_dim|widths|out_channels|neck_hidden_sizes)$")


def _is_hidden(k: str, v) -> bool:
    return bool(_HIDDEN.search(k)) and "head" not in k and isinstance(v, int) and not isinstance(v, bool) and v > 0


def _round(value: float, to: int = 8) -> int:
    return max(to, round(value / to) * to)


def _layer_pick(kinds: list) -> list:
    """Two entries of a per-layer list: the first, and the first that differs from it (a hybrid stays hybrid)."""
    other = next((k for k in kinds[1:] if k != kinds[0]), kinds[1] if len(kinds) > 1 else kinds[0])
    return [kinds[0], other]


def shrink(d: dict, widths: bool = True) -> dict:
    """A small copy of one config's fields (recursively for sub-configs), by the rule in the module docstring;
    ``widths=False``: the layers alone (the full model's widths at the small one's depth, to size its parameters)."""
    if not all(isinstance(k, str) for k in d):
        return d  # a table (id2label), not a config
    hidden = next((v for k, v in d.items() if _is_hidden(k, v)), None)
    heads = next(
        (
            v
            for k, v in d.items()
            if k in ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads")
            and isinstance(v, int)
        ),
        None,
    )
    layers = {
        v
        for k, v in d.items()
        if isinstance(v, int)
        and not isinstance(v, bool)
        and v > 2
        and (_LAYERS.search(k.lower()) or (k.startswith("num_") and k.endswith("_layers")))
    }
    out = {}
    for key, value in d.items():
        k = key.lower()
        if isinstance(value, dict):
            out[key] = _rope(value) if "rope" in k and widths else shrink(value, widths)
        elif isinstance(value, bool) or value is None or isinstance(value, (float, str)):
            out[key] = value
        elif isinstance(value, int):
            out[key] = _int(k, value, hidden, heads) if widths else _depth(k, value, value)
        elif isinstance(value, (list, tuple)):
            out[key] = _list(k, list(value), layers, hidden, widths)
        else:
            out[key] = value
    return _ssm_heads(out) if widths else out


def _ssm_heads(d: dict) -> dict:
    """State-space heads tile the expanded width: head dim = hidden * expand / heads (fields of one prefix)."""
    hidden = next((v for k, v in d.items() if _is_hidden(k, v)), None)
    for prefix in ("", "mamba_", "ssm_"):
        expand = d.get(prefix + "expand")
        heads = next((k for k in (prefix + "num_heads", prefix + "n_heads") if isinstance(d.get(k), int)), None)
        dim = next((k for k in (prefix + "head_dim", prefix + "d_head") if isinstance(d.get(k), int)), None)
        if isinstance(expand, (int, float)) and hidden and heads and dim:
            d[dim] = int(hidden * expand) // d[heads]
    return d


def _int(k: str, v: int, hidden: int | None, heads: int | None) -> int:
    if "vocab_size" in k or k in ("n_positions_vocab", "num_tokens"):
        return min(v, VOCAB)
    if _TOKEN.search(k) and v >= VOCAB - 64:
        return VOCAB - 1 - zlib.crc32(k.encode()) % 48  # special tokens stay distinct, above the ids the inputs draw
    if _KV.search(k):
        return v if v <= 1 else (HEADS if heads is not None and v >= heads else min(v, 2))
    if "head_dim" in k or k in (
        "attention_head_size",
        "d_kv",
        "kv_channels",
        "head_size",
        "dim_head",
        "d_head",
        "rotary_dim",
        "rotary_emb_dim",
        "rope_dim",
        "mamba_d_head",
    ):
        return min(v, HEAD_DIM)  # before the heads: "d_head" ends as a count of heads would
    if _HEADS.search(k) or (k.startswith("num_") and k.endswith("_heads")):
        return min(v, HEADS)
    if "lora_rank" in k:
        return min(v, 32)
    if _EXPERTS.search(k):
        return min(v, EXPERTS)
    if _TOPK.search(k):
        return min(v, 2)
    if k in ("n_shared_experts", "num_shared_experts"):
        return min(v, 1)
    if k in ("n_group", "n_groups", "num_groups", "num_expert_groups", "ngroups"):
        return min(v, 2)
    if k in ("topk_group", "num_limited_groups"):
        return min(v, 1)
    if _INTER.search(k) and v > 0:
        return _round(v * HIDDEN / hidden, 16) if hidden and hidden > HIDDEN else v
    if _HIDDEN.search(k):
        return min(v, HIDDEN)
    depth = _depth(k, v, None)
    if depth is not None:
        return depth
    if k in ("image_size", "img_size", "input_size", "crop_size"):
        return v  # fixed in _vision below, once the patch size is known
    if k in ("max_source_positions", "max_target_positions", "max_text_positions"):
        return min(v, 64)
    if k in ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length") and v > 4096:
        return 4096
    return v


_DEPTHS = ("depths", "num_layers", "layers", "depth", "blocks_per_stage", "stage_depths", "num_blocks")
_FEATURE_LAYERS = ("vision_feature_layer", "feature_layers")


def _depth(k: str, v: int, other: int | None) -> int | None:
    """A field of the model's depth (layers, a layer pattern's period, a layer index) at 2 layers; else ``other``."""
    if "first_k_dense" in k:
        return min(v, 1)
    if _LAYERS.search(k) or (k.startswith("num_") and k.endswith("_layers")):
        return min(v, 2)
    if k.endswith("_period") or k.endswith("_frequency") or k.endswith("_freq") or k == "sliding_window_pattern":
        return min(v, 2)
    if k.endswith("_offset") and "layer" in k:
        return v % 2
    if k.endswith("_layer") or k.endswith("feature_layer"):
        return v if v < 0 else min(v, 1)
    return other


def _list(k: str, v: list, layers: set, hidden: int | None, widths: bool = True) -> list:
    if not v or not all(isinstance(x, (int, str, bool, float, type(None))) for x in v):
        return v
    ints = all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    if k in ("out_features", "out_indices"):
        return None  # a backbone's default: its last stage
    if len(v) in layers:
        v = _layer_pick(v)  # a per-layer list: layer_types, intermediate sizes a layer, ...
        if k.endswith("intermediate_size") and ints and hidden and widths:
            return [_round(x * HIDDEN / hidden, 16) for x in v]
        return v
    if not ints or (not widths and not (k.endswith("_layers") or k in _DEPTHS or k in _FEATURE_LAYERS)):
        return v
    if "section" in k and sum(v) > HEAD_DIM // 2:  # multimodal rotary sections share head_dim / 2
        scaled = [max(1, x * (HEAD_DIM // 2) // sum(v)) for x in v]
        scaled[-1] += HEAD_DIM // 2 - sum(scaled)
        return scaled
    if _LIST_WIDTH.search(k):
        factor = max(1, max(v) // (2 * HIDDEN))
        return [_round(x / factor) if x > 8 else x for x in v]
    if k in _DEPTHS:
        return [min(x, 1) for x in v]
    if _HEADS.search(k) or k.endswith("_heads"):
        return [min(x, 2) for x in v]
    if k.endswith("_layers") or k in ("mlp_only_layers",):
        return [x for x in v if x < 2]
    if k in _FEATURE_LAYERS:
        return [x if x < 0 else min(x, 1) for x in v][-1:]
    return v


def _rope(d: dict) -> dict:
    out = dict(d)
    for key, value in d.items():
        if isinstance(value, list) and "section" in key:
            out[key] = _list(key, value, set(), None)
    return out


def _vision(d: dict) -> dict:
    """Images of 4 x 4 patches (at least 64 pixels a side), recursively."""
    out = {k: _vision(v) if isinstance(v, dict) else v for k, v in d.items()}
    patch = out.get("patch_size")
    patch = patch[0] if isinstance(patch, (list, tuple)) and patch else patch
    for key in ("image_size", "img_size", "crop_size"):
        size = out.get(key)
        if isinstance(size, int) and size > 64:
            out[key] = math.ceil(64 / patch) * patch if isinstance(patch, int) and patch > 0 else 64
        elif isinstance(size, (list, tuple)) and size and all(isinstance(x, int) for x in size) and max(size) > 64:
            side = math.ceil(64 / patch) * patch if isinstance(patch, int) and patch > 0 else 64
            out[key] = [min(x, side) for x in size]
    return out


def hf_types() -> list[str]:
    from transformers import CONFIG_MAPPING

    return sorted(CONFIG_MAPPING.keys())


def hf_class(model_type: str, config=None):
    """The ``...ForCausalLM`` class where the type has one (not for an encoder-decoder, whose causal LM is its
    decoder alone), else the base model class (AutoModel's), else None."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    for mapping in (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_MAPPING_NAMES):
        name = mapping.get(model_type)
        name = name[0] if isinstance(name, (list, tuple)) else name
        if mapping is auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and (
            not str(name).endswith("ForCausalLM") or getattr(config, "is_encoder_decoder", False)
        ):
            continue
        if name and hasattr(transformers, name):
            return getattr(transformers, name)
    return _model_of(model_type)


def _model_of(model_type: str):
    """A sub-config's type (``clip_text_model``): the ``...Model`` of its config's own modeling module."""
    import importlib

    from transformers import CONFIG_MAPPING, PreTrainedModel

    config_cls = CONFIG_MAPPING[model_type]
    try:
        module = importlib.import_module(config_cls.__module__.replace(".configuration_", ".modeling_"))
    except ImportError:
        return None
    found = [
        c
        for c in vars(module).values()
        if isinstance(c, type)
        and issubclass(c, PreTrainedModel)
        and c.__name__.endswith("Model")
        and getattr(c, "config_class", None) is config_cls
    ]
    return found[0] if found else None


def hf_config(model_type: str, widths: bool = True):
    """The shrunk config; ``widths=False``: the full one's widths at the same depth (to size its parameters)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    small = _vision(shrink(cls().to_dict())) if widths else shrink(cls().to_dict(), widths=False)
    small.pop("transformers_version", None)
    config = cls.from_dict(small)
    for sub in [config, *[v for v in vars(config).values() if hasattr(v, "to_dict") and hasattr(v, "use_cache")]]:
        if hasattr(sub, "use_cache"):
            sub.use_cache = False
    return config


def family(cls, config) -> str:
    """The sweep's family of a model class and its config, from config fields and the main input only."""
    import json

    flat = json.dumps(config.to_dict(), default=str)
    main = getattr(cls, "main_input_name", "input_ids")
    if re.search(r'"(num_experts|num_local_experts|n_routed_experts|moe_num_experts)": [2-9]', flat):
        return "MoE"
    if re.search(r'(ssm|mamba|state_size|d_state|linear_attn|linear_attention|"recurrent|rwkv|delta_rule)', flat, re.I):
        return "SSM/hybrid"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder"
    if main in ("input_features", "input_values"):
        return "audio"
    if main.startswith("pixel_values"):
        return "vision"
    if any(k.endswith(("vision_config", "audio_config")) for k in config.to_dict()):
        return "multimodal"
    return "causal LM" if cls.__name__.endswith("ForCausalLM") else "text encoder"


def _field(config, *names, default=None):
    """The first of ``names`` set on the config or any of its sub-configs (breadth first)."""
    todo = [config]
    while todo:
        c = todo.pop(0)
        for name in names:
            v = getattr(c, name, None)
            if v is not None and not isinstance(v, bool):
                return v
        todo += [v for v in vars(c).values() if hasattr(v, "to_dict") and hasattr(v, "model_type")]
    return default


def _side(value) -> int:
    return value[0] if isinstance(value, (list, tuple)) else int(value)


def _tensor(name: str, config, generator, layout: int = 0):
    """One input, made from config fields alone."""
    if name in ("input_ids", "decoder_input_ids", "labels", "token_ids", "input_tokens"):
        vocab = _field(config, "vocab_size", default=VOCAB)
        return torch.randint(1, max(2, min(vocab, VOCAB) - 64), (BATCH, SEQ), generator=generator)
    if name in ("pixel_values", "pixel_values_videos", "images", "image"):
        side = _side(_field(config, "image_size", "img_size", "crop_size", default=64))
        channels = _field(config, "num_channels", "in_channels", "input_channels", "in_chans", default=3)
        return torch.randn(BATCH, channels, side, side, generator=generator)
    if name == "input_features":
        bins = _field(config, "num_mel_bins", "feature_size", "input_feat_per_channel", "n_mels", default=80)
        sources = _field(config, "max_source_positions", default=None)
        frames = 2 * sources if isinstance(sources, int) else 64
        shape = (BATCH, bins, frames) if layout == 0 else (BATCH, frames, bins)
        return torch.randn(*shape, generator=generator)
    if name == "input_values":
        return torch.randn(BATCH, 4000, generator=generator)
    if name == "attention_mask":
        return torch.ones(BATCH, SEQ, dtype=torch.long)
    return None


def inputs(model: torch.nn.Module, config, seed: int = 0, layout: int = 0) -> dict:
    """Keyword inputs from ``main_input_name`` and the config; encoder-decoders also get ``decoder_input_ids``."""
    generator = torch.Generator().manual_seed(seed)
    main = getattr(model, "main_input_name", "input_ids")
    made = {main: _tensor(main, config, generator, layout)}
    params = inspect.signature(model.forward).parameters
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params and main != "decoder_input_ids":
        made["decoder_input_ids"] = _tensor("decoder_input_ids", config, generator)
    if made[main] is None:
        raise ValueError(f"no generic input for main_input_name {main!r}")
    return made


def missing_input(error: Exception, model) -> str | None:
    """The forward parameter an error says is missing (``You have to specify pixel_values``), if we can make it."""
    text, params = str(error), inspect.signature(model.forward).parameters
    makeable = ("pixel_values", "input_ids", "decoder_input_ids", "input_features", "input_values", "attention_mask")
    named = [n for n in params if n in text and n in makeable]
    return named[0] if named else next((n for n in params if n in makeable[:2]), None)


# models of other libraries: (name, family, factory() -> (model, kwargs)); installed by the "sweep" extra
