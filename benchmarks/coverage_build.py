"""Building a sweep entry's model and inputs, and the timeouts and error lines every part of the sweep shares."""

from __future__ import annotations

import signal

import coverage_models as cm
import torch
from coverage_library import OTHERS


class Timeout(Exception):
    pass


def alarm(seconds: int):
    def fire(*_):
        raise Timeout(f"took over {seconds} s")

    signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


def names() -> list[str]:
    return cm.hf_types() + list(OTHERS)


def build(name: str, device: str, spec: dict | None = None):
    """(model in eval mode, keyword inputs, family); ``spec``: the input layout and extra inputs a probe found."""
    torch.manual_seed(0)
    if name in OTHERS:
        with torch.device(device):
            model, kwargs = OTHERS[name]()
        return model.eval(), {k: v.to(device) for k, v in kwargs.items()}, "other library"
    config = cm.hf_config(name)
    cls = cm.hf_class(name, config)
    if cls is None:
        raise LookupError("no causal-LM or base model class in transformers")
    with torch.device(device):
        model = cls(config).eval()
    spec = spec or {"layout": 0, "extra": []}
    kwargs = cm.inputs(model, config, layout=spec["layout"])
    for extra in spec["extra"]:
        kwargs[extra] = cm._tensor(extra, config, torch.Generator().manual_seed(1))
    return model, {k: v.to(device) for k, v in kwargs.items()}, cm.family(type(model), config)


def probe(name: str) -> dict:
    """Build on the CPU and find inputs a forward accepts: the audio layout, inputs the error names as missing."""
    model, kwargs, family = build(name, "cpu")
    if name in OTHERS:
        with torch.no_grad():
            model(**kwargs)
        return {"layout": 0, "extra": [], "family": family}
    error = None
    for layout in (0, 1):
        spec = {"layout": layout, "extra": []}
        for _ in range(3):
            model, kwargs, family = build(name, "cpu", spec)
            try:
                with torch.no_grad():
                    model(**kwargs)
                return {**spec, "family": family}
            except Exception as exc:  # any model's error: try the next inputs
                error = exc
                missing = cm.missing_input(exc, model)
                if missing is None or missing in kwargs:
                    break
                spec["extra"].append(missing)
        if getattr(model, "main_input_name", "") != "input_features":
            break
    raise error


def family_of(name: str) -> str | None:
    """``family`` from the shrunk config, without building the model; None where the config does not build."""
    if name in OTHERS:
        return "other library"
    try:
        config = cm.hf_config(name)
        return cm.family(cm.hf_class(name, config), config)
    except Exception:  # a config that does not build: no family
        return None
