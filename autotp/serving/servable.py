"""Whether ``autotp serve`` can serve a model directory, found before any rank starts: one ValueError, one line.

What is checked is what a rank would otherwise fail on minutes later, each from transformers' own tables and the
config's fields (never a model's name): the model is a decoder-only causal LM (not an encoder-decoder; not an encoder
family such as BERT's, which transformers maps to a masked LM, and whose causal-LM class is that encoder); its
attention layers are ones the paged cache serves; the tokenizer loads and its ids fit the model's vocabulary; and the
safetensors weights hold every tensor of the model at its shape (read from the files' headers, the model built on
the meta device).
"""

from __future__ import annotations

from pathlib import Path


def check_servable(directory: str | Path) -> None:
    """Raise ValueError (one line: what is wrong and what to do) unless ``directory`` can be served."""
    config = _config(directory)
    _check_decoder_only(directory, config)
    text = config.get_text_config()
    from autotp.serving.paged_cache import attention_layer_types

    attention_layer_types(text)
    _check_tokenizer(directory, text.vocab_size)
    _check_weights(directory, config)


def _config(directory):
    from transformers import AutoConfig

    if not (Path(directory) / "config.json").is_file():
        raise ValueError(f"{directory} has no config.json: give a directory saved by save_pretrained")
    try:
        return AutoConfig.from_pretrained(directory)
    except Exception as exc:  # transformers' own reason, on one line
        raise ValueError(f"{directory}/config.json does not load: {_first_line(exc)}") from None


def _check_decoder_only(directory, config) -> None:
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    kind = config.model_type
    serves = "autotp serve serves decoder-only causal LMs"
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{directory} holds an encoder-decoder model ({type(config).__name__}): {serves}")
    if kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        raise ValueError(
            f"{directory} holds an encoder ({type(config).__name__}, whose family transformers maps to a "
            f"masked LM): {serves}"
        )
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{directory} holds a {type(config).__name__}, which has no causal LM class in transformers: {serves}"
        )
    causal = {
        name
        for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
        for name in ((names,) if isinstance(names, str) else names)
    }
    named = list(getattr(config, "architectures", None) or [])
    if named and not set(named) & causal:
        raise ValueError(
            f"{directory} holds a {named[0]}, not a causal LM (its weights have no LM head to serve): {serves}"
        )


def _check_tokenizer(directory, vocab_size: int) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except Exception as exc:
        raise ValueError(
            f"{directory} has no tokenizer that loads ({_first_line(exc)}): save the model's tokenizer "
            "there with save_pretrained"
        ) from None
    if isinstance(tokenizer, bool) or not callable(getattr(tokenizer, "decode", None)):
        raise ValueError(f"{directory} has no tokenizer: save the model's tokenizer there with save_pretrained")
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"{directory}'s tokenizer has {len(tokenizer)} tokens but the model's vocabulary "
            f"{vocab_size}: its ids would index past the embedding"
        )


def _check_weights(directory, config) -> None:
    """Every tensor the model holds is in the safetensors files at its shape (autotp's own check, as each rank
    makes it when it reads its pieces), the model built on the meta device."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from autotp.runtime.conversion import model_conversions
    from autotp.runtime.hf_checkpoint import Checkpoint, check_tensors
    from autotp.runtime.quantized import check_quantized, quantization, quantize_modules

    scheme = quantization(config)  # a format autotp does not read is refused
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()
    quantize_modules(model, scheme)  # a quantized checkpoint holds its linears' stored tensors
    if scheme is not None:
        check_quantized(Checkpoint(directory), model, scheme)
    check_tensors(Checkpoint(directory, model_conversions(model)), model)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
