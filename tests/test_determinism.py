"""Plans depend on nothing process-local (hash seeds, memory addresses): one model of each family the suite
builds, planned in two fresh processes with different hash seeds, gives the same fingerprints and the same plan
JSON (a plan made on one machine is checked against a graph captured on another; ranks agree by fingerprint).

Each process plans every model and prints {name: [fingerprint, sha256 of plan.to_json()]}: two launches."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from tests.helpers.native_models import VOCAB

ROOT = Path(__file__).resolve().parent.parent
SEEDS = ("0", "1")  # iterate {"full_attention", "sliding_attention"} (set or list-made) in other orders


class ByLayerType(nn.Module):
    """ModernBERT's and Gemma3's forward: a rotary table for each layer type, computed in the order of
    ``set(config.layer_types)`` (strings: an order the hash seed picks), then read by the layers of that type."""

    KINDS = ("full_attention", "sliding_attention")

    def __init__(self, dim: int = 16):
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, dim), nn.Linear(dim, VOCAB, bias=False)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in self.KINDS)
        for k, kind in enumerate(self.KINDS):
            self.register_buffer(f"{kind}_inv_freq", 1.0 / (10.0 ** (k + 1)) ** (torch.arange(dim) / dim))

    def forward(self, ids):
        h, position = self.emb(ids), torch.arange(ids.shape[1], device=ids.device)
        tables = {kind: (position[:, None] * getattr(self, f"{kind}_inv_freq")).cos() for kind in set(self.KINDS)}
        for kind, layer in zip(self.KINDS, self.layers, strict=True):
            h = h + layer(h * tables[kind])
        return self.head(h)


def _ids(seq: int = 8, vocab: int = 90) -> tuple:
    return (torch.randint(0, vocab, (2, seq)),)


def _hf(cls: str, config) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    return getattr(transformers, cls)(config).eval()


def models() -> dict:
    """name -> a function making (model, args): one of each family the suite builds, tiny, fixed seeds."""
    from torch.nn.attention.flex_attention import create_block_mask

    from tests.helpers import configs, native_models
    from tests.helpers import models as builders
    from tests.helpers.architectures import hf_model

    def flex(mode, mask=False):
        def make():
            ids = torch.randint(0, VOCAB, (2, 16 if mask else 8))
            extra = (create_block_mask(native_models.causal, None, None, 16, 16, device="cpu"),) if mask else ()
            return native_models.flex_lm(mode, dim=16, heads=4, kv_heads=2, layers=1), (ids, *extra)

        return make

    one = {"num_hidden_layers": 1}
    return {
        "mlp": lambda: builders.build("mlp")[:2],
        "unruly": lambda: builders.build("unruly")[:2],
        "nanogpt": lambda: builders.build("nanogpt", blocks=1)[:2],
        "llama": lambda: (builders.llama_with(heads=4, kv=2), _ids()),
        "mistral_sliding": lambda: (hf_model("mistral", **one), _ids()),
        # alternating sliding-window and full-attention layers (Gemma2's, Cohere2's layout)
        "qwen2_alternating": lambda: (
            hf_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1),
            _ids(),
        ),
        "bert_encoder": lambda: (hf_model("bert", **one), _ids()),
        "bloom_alibi": lambda: (_hf("BloomForCausalLM", configs.bloom(n_layer=1)), _ids()),
        "mixtral_moe": lambda: (_hf("MixtralForCausalLM", configs.mixtral(**one)), _ids()),
        "vit": lambda: (builders.vit(layers=1), (torch.randn(2, 3, 16, 16),)),
        "torch_encoder": lambda: (native_models.torch_layers_lm("encoder", layers=1), _ids(vocab=VOCAB)),
        "complex_rotary": lambda: (native_models.complex_rotary_lm(layers=1), _ids(vocab=VOCAB)),
        "flex_forward_mask": flex("forward_mask"),
        "flex_alibi_h": flex("alibi_h"),
        "flex_input_mask": flex("input_mask", mask=True),
        # issued in the order of a set of strings: the same graph up to the order of independent ops
        "set_order": lambda: (ByLayerType(), _ids(vocab=VOCAB)),
        "gemma3_sliding_full": lambda: (_hf("Gemma3ForCausalLM", configs.by_layer_type("Gemma3TextConfig")), _ids()),
        "modernbert_encoder": lambda: (_hf("ModernBertModel", configs.by_layer_type("ModernBertConfig")), _ids()),
    }


def plans(names=None) -> dict:
    """name -> [fingerprint, sha256 of the plan's JSON], for every model (or those named)."""
    import autotp

    out = {}
    for name, make in models().items():
        if names and name not in names:
            continue
        torch.manual_seed(0)
        model, args = make()
        plan = autotp.plan(model, args, world_size=2)
        out[name] = [plan.fingerprint, hashlib.sha256(plan.to_json().encode()).hexdigest()[:16]]
    return out


def _in_processes(seeds=SEEDS) -> list[dict]:
    """plans() in a fresh process for each hash seed (and its own memory addresses), side by side; their output
    goes to files, so neither waits on a full pipe."""

    def start(seed):
        env = {**os.environ, "PYTHONHASHSEED": seed, "OMP_NUM_THREADS": "1"}
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        return (
            subprocess.Popen(
                [sys.executable, "-m", "tests.test_determinism"], cwd=ROOT, env=env, text=True, stdout=out, stderr=err
            ),
            out,
            err,
        )

    found = []
    for process, out, err in [start(seed) for seed in seeds]:
        with out, err:
            process.wait(timeout=600)
            out.seek(0), err.seek(0)
            assert process.returncode == 0, err.read()[-4000:]
            found.append(json.loads(out.read().strip().splitlines()[-1]))
    return found


def test_plans_are_the_same_in_processes_with_other_hash_seeds():
    first, second = _in_processes()
    assert first.keys() == second.keys() == models().keys()
    differing = {name: (first[name], second[name]) for name in first if first[name] != second[name]}
    assert not differing, differing


if __name__ == "__main__":
    print(json.dumps(plans(sys.argv[1:])))
