"""A command's MODEL argument read: ``package.module:factory``, a Hugging Face ``config.json`` or a model
directory, built on the meta device.  A config's mistakes are said before planning, not found in its numbers: a
broken file by its JSON error's line, a misspelt field by the field it nearly names and the default then used."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import os
import sys
from pathlib import Path

import torch

from autotp.tools.cli_errors import UsageError

NEAR_MISS = 0.85  # difflib's ratio above which an unknown key is taken for a misspelt field


def load_model(spec: str, batch: int, seq: int):
    """(model, example_args) on the meta device from ``spec``: no weights are read, so any size plans on a
    laptop."""
    path = Path(spec)
    if path.is_dir() or path.suffix == ".json":
        return _from_config(path / "config.json" if path.is_dir() else path, batch, seq)
    module, _, name = spec.partition(":")
    if not name:
        if os.sep in spec or "/" in spec:
            raise UsageError(
                f"{spec} does not exist", "give a config.json, a model directory holding one, or package.module:factory"
            )
        raise UsageError(
            f"MODEL must be package.module:factory, a config.json or a model directory, got {spec!r}",
            "see autotp plan --help",
        )
    sys.path.insert(0, os.getcwd())  # like `python -m`: modules of the current directory are importable
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise UsageError(
            f"cannot load {spec!r} ({exc})",
            "run from the directory that holds the module, or give its full package path",
        ) from exc
    with torch.device("meta"):
        return factory()


def _from_config(config_path: Path, batch: int, seq: int):
    if not config_path.exists():
        raise UsageError(
            f"{config_path} does not exist",
            "give a config.json, a model directory holding one, or package.module:factory",
        )
    try:
        fields = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"{config_path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
            "fix that line (or give another config.json)",
        ) from exc
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(config_path))
    for line in near_misses(fields, config):
        print(f"autotp: {config_path}: {line}", file=sys.stderr)
    config.use_cache = False
    from autotp.runtime.quantized import quantize_modules

    with torch.device("meta"):
        model = quantize_modules(AutoModelForCausalLM.from_config(config))  # quantized bytes, as stored
    return model, (torch.zeros(batch, seq, dtype=torch.long, device="meta"),)


def known_fields(config) -> set[str]:
    """The fields ``config``'s class declares (its dataclass fields and their aliases)."""
    cls = type(config)
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return names | set(getattr(cls, "attribute_map", {}))


def near_misses(fields: dict, config) -> list[str]:
    """One line per key of the file that is not a field of the config's class but nearly names one the file
    left out, so that field's default was used: "did you mean num_hidden_layers? using the default 32".  Keys
    that name no missing field (the legacy keys real configs carry) stay quiet."""
    known = known_fields(config)
    missing = sorted(known - set(fields))
    lines = []
    for key in fields:
        if key in known or key.startswith("_"):
            continue
        close = difflib.get_close_matches(key, missing, n=1, cutoff=NEAR_MISS)
        if close:
            default = getattr(config, close[0], None)
            name = type(config).__name__
            lines.append(f"{key} is not a field of {name}: did you mean {close[0]}? using the default {default!r}")
    return lines
