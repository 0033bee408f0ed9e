"""Tiny models for tests: random weights from configs, no network."""

from __future__ import annotations

import torch

from examples import mlp, nanogpt
from tests.helpers import configs

BLOCKS = 2


class Unruly(torch.nn.Module):
    """Ops without sharding rules (sort with indices, cumprod along the hidden dim) between matmuls."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(32, 128)
        self.down = torch.nn.Linear(128, 32)

    def forward(self, x):
        h = self.up(x)
        ranked, order = h.sort(dim=-1)
        top, where = ranked[..., -1:], order[..., -1:]
        h = torch.cumprod(1 + (h - top) / 1024, dim=-1) / 128
        return self.down(h.relu()) + where.float() / 128


class ParallelBranches(torch.nn.Module):
    """x + (mlp_a(ln(x)) + mlp_b(ln(x))): a parallel attention+MLP residual (GPT-J, Falcon) without biases."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.ln = torch.nn.LayerNorm(hidden)
        self.a_in = torch.nn.Linear(hidden, 4 * hidden, bias=False)
        self.a_out = torch.nn.Linear(4 * hidden, hidden, bias=False)
        self.b_in = torch.nn.Linear(hidden, 4 * hidden, bias=False)
        self.b_out = torch.nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x):
        y = self.ln(x)
        return x + (self.a_out(torch.relu(self.a_in(y))) + self.b_out(torch.nn.functional.gelu(self.b_in(y))))


class SignedBranches(torch.nn.Module):
    """x - a(ln(x)) + 0.5 * b(ln(x)), biases on every linear: a replicated operand first in a
    subtraction, and a partial operand scaled by add's alpha."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.ln = torch.nn.LayerNorm(hidden)
        self.a_in, self.a_out = torch.nn.Linear(hidden, 2 * hidden), torch.nn.Linear(2 * hidden, hidden)
        self.b_in, self.b_out = torch.nn.Linear(hidden, 2 * hidden), torch.nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        y = self.ln(x)
        return torch.add(x - self.a_out(torch.relu(self.a_in(y))), self.b_out(torch.relu(self.b_in(y))), alpha=0.5)


def build(kind: str, device: str = "cpu", blocks: int = BLOCKS):
    """(model, example args, number of transformer blocks) with a fixed seed."""
    torch.manual_seed(0)
    with torch.device(device):
        if kind == "mlp":
            model, args = mlp.build(hidden=32, ffn=128)
            return model.eval(), args, 0
        if kind == "unruly":
            return Unruly().eval(), (torch.randn(2, 8, 32),), 0
        if kind == "nanogpt":
            model, args = nanogpt.build(n_layer=blocks, n_head=4, n_embd=32)
            return model.eval(), args, blocks
        if kind == "llama":
            from transformers import LlamaForCausalLM

            config = configs.llama(
                vocab_size=128,
                intermediate_size=128,
                num_hidden_layers=blocks,
                num_attention_heads=8,
                num_key_value_heads=4,
            )
            model = LlamaForCausalLM(config)
        elif kind == "phi3":  # fused qkv cut with slices (GQA sizes), fused gate_up cut with chunk
            from transformers import Phi3ForCausalLM

            config = configs.phi3(
                vocab_size=128,
                intermediate_size=128,
                num_hidden_layers=blocks,
                num_key_value_heads=4,
                pad_token_id=0,
                bos_token_id=0,
                eos_token_id=0,
            )
            model = Phi3ForCausalLM(config)
        elif kind == "gpt2":
            from transformers import GPT2LMHeadModel

            config = configs.gpt2(vocab_size=128, n_layer=blocks, bos_token_id=0, eos_token_id=0)
            model = GPT2LMHeadModel(config)
        else:
            raise ValueError(kind)
    return model.eval(), (torch.randint(0, 128, (2, 8)),), blocks


def llama_with(heads: int, kv: int, head_dim: int = 8, vocab: int = 96, layers: int = 1):
    """A LLaMA with the given head counts (head sharing and uneven splits), fixed seed."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        configs.llama(
            hidden_size=heads * head_dim,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim,
            vocab_size=vocab,
            num_hidden_layers=layers,
        )
    ).eval()


def phi2(layers: int = 2):
    """Phi-2's layout: one layer norm feeding attention and MLP in parallel, biases on every linear."""
    from transformers import PhiForCausalLM

    torch.manual_seed(0)
    return PhiForCausalLM(configs.phi(num_hidden_layers=layers)).eval()


def vit(image: int = 16, patch: int = 4, layers: int = 2):
    """A ViT classifier: convolutional patches, a class token and a learned position table, so the
    sequence length is fixed by the config ((image / patch)^2 + 1 tokens: 17 by default)."""
    from transformers import ViTForImageClassification

    torch.manual_seed(0)
    return ViTForImageClassification(configs.vit(image_size=image, patch_size=patch, num_hidden_layers=layers)).eval()


def padded_prompts(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of 6 tokens, two of them left-padded (as generate expects), and their attention mask."""
    torch.manual_seed(3)
    ids = torch.randint(3, vocab, (3, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


def logits(out):
    return getattr(out, "logits", out)


def example_input(kind: str, batch: int, seq: int) -> torch.Tensor:
    if kind in ("mlp", "unruly"):
        return torch.randn(batch, seq, 32)
    return torch.randint(0, 96, (batch, seq))


def pretrained_models(*directories: str) -> list:
    """The models ``autotp.from_pretrained`` builds from these directories and the inputs it captures them with."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from autotp.runtime.hf_models import default_inputs

    pairs = []
    for directory in directories:
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), torch_dtype=None)
        model.tie_weights()
        pairs.append((model.eval(), default_inputs(model)))
    return pairs
