"""Inputs matched by structure, not by object: a BlockMask rebuilt every batch (a new ``and_masks`` closure over
new document ids) is the captured program's input as it was, its document ids read on every call; a structure or
a length the capture excluded (another mask length, a length that is not a multiple of a layer's chunk) gets a
program of its own, captured and planned again over the group, holding the same parameters; or, with
``recaptures=0``, one line that says what differs."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention.flex_attention import and_masks, create_block_mask
from torch.utils._pytree import tree_flatten

import autotp
from autotp.ops.flex import exportable_on_cpu, register_block_mask
from autotp.passes.capture import capture
from autotp.runtime.programs import InputStructureError, call_difference, refusal, spec_difference
from tests.helpers import configs
from tests.helpers.distributed import run_ranks
from tests.helpers.exact import TOL, sums_per_block, training_matches
from tests.helpers.native_models import VOCAB, flex_lm


def causal(b, h, q, kv):
    return q >= kv


def same_document(documents: torch.Tensor):
    def same(b, h, q, kv):
        return documents[b, q] == documents[b, kv]

    return same


def packed_batch(batch: int, seq: int, seed: int) -> tuple:
    """Token ids and a causal, per-document BlockMask for them, built as a training loop builds it: anew."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    documents = torch.cumsum(torch.rand(batch, seq, generator=g) < 0.25, 1)
    mask = create_block_mask(and_masks(causal, same_document(documents)), batch, None, seq, seq, device="cpu")
    return ids, mask


def test_a_mask_rebuilt_per_batch_is_the_same_input():
    """New closures over other document ids flatten to the same structure; their document ids are leaves the
    captured program reads (outputs equal the model's for each batch's own documents), and another mask
    function is another structure, named as such."""
    register_block_mask()
    first, again = packed_batch(2, 16, 0), packed_batch(2, 16, 1)
    leaves, spec = tree_flatten(first)
    assert tree_flatten(again)[1] == spec
    assert any(
        x is first[1].mask_mod.__closure__[0].cell_contents[1].__closure__[0].cell_contents for x in leaves
    )  # the document ids are an input, not a constant of the capture
    assert "0x" not in str(spec)  # no address: specs are compared and shown across processes
    model = flex_lm("input_mask", dim=32, heads=4, kv_heads=2)
    program = capture(model, first)
    with exportable_on_cpu():
        for inputs in (first, again, packed_batch(2, 16, 2)):
            assert refusal(program, inputs, {}) is None
            torch.testing.assert_close(program(*inputs), model(*inputs), **TOL)
    other = (first[0], create_block_mask(causal, 2, None, 16, 16, device="cpu"))
    assert "and_mask" in refusal(program, other, {}) and "causal" in refusal(program, other, {})


def test_the_difference_is_named_where_it_is():
    register_block_mask()
    _, want = tree_flatten((packed_batch(2, 16, 0), {}))
    _, longer = tree_flatten((packed_batch(2, 24, 0), {}))
    assert call_difference(want, want) == "the inputs' structure differs"  # (refusal asks only when they do)
    found = call_difference(want, longer)
    assert found.startswith("args[1] (a BlockMask) has (24, 24) where it had (16, 16)"), found
    _, other = tree_flatten((({"ids": torch.zeros(1)},), {}))
    plain = tree_flatten(((torch.zeros(1),), {}))[1]
    assert call_difference(plain, other) == "args[0] is a dict, was a leaf (a tensor or value)"
    assert call_difference(plain, tree_flatten(((torch.zeros(1), 1), {}))[1]) == "args has 2 entries, had 1"
    _, keyword = tree_flatten(((torch.zeros(1),), {"scale": 2.0}))
    assert call_difference(plain, keyword) == "kwargs name ['scale'], were []"
    assert spec_difference(want, want) == ""


def _documents(rank: int, world: int) -> None:
    model = flex_lm("input_mask", dim=32, heads=4, kv_heads=2)
    sharded = autotp.parallelize(model, packed_batch(2, 16, 0))
    plan = sharded.autotp_plan
    assert plan.replicated_ops == [] and set(sums_per_block(plan).values()) == {2}, plan.collectives
    with exportable_on_cpu():
        training_matches(model, sharded, [packed_batch(2, 16, step + 1) for step in range(3)])
        new = r"again for a call of a new structure \(args\[1\] \(a BlockMask\) has \(24, 24\)"
        with pytest.warns(UserWarning, match=new):
            longer = packed_batch(3, 24, 9)
            torch.testing.assert_close(sharded(*longer), model(*longer), **TOL)
        for seed in (10, 11):  # the second program serves its structure from now on, the first its own
            for batch, seq in ((3, 24), (2, 16)):
                inputs = packed_batch(batch, seq, seed)
                torch.testing.assert_close(sharded(*inputs), model(*inputs), **TOL)
    assert len(sharded.autotp_programs.others) == 1


def test_document_masks_rebuilt_every_batch_train_at_two_ranks():
    """Three SGD steps, each on a new batch with a new per-document mask, equal one process; then a new sequence
    length (another BlockMask structure) is captured again, exact, with the same weights."""
    run_ranks(2, _documents)


class ChunkPadded(torch.nn.Module):
    """A state-space-like layer that pads the sequence to a multiple of its chunk (as transformers' SSM layers
    do) and scans chunk by chunk: capture guards on ``seq % chunk``."""

    def __init__(self, dim: int = 16, chunk: int = 8):
        super().__init__()
        self.chunk = chunk
        self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        pad = (self.chunk - s % self.chunk) % self.chunk
        h = torch.nn.functional.pad(torch.nn.functional.silu(self.up(x)), (0, 0, 0, pad))
        chunks = h.view(b, -1, self.chunk, h.shape[-1]).cumsum(2)  # within each chunk
        carried = chunks[:, :, -1].cumsum(1) - chunks[:, :, -1]  # what earlier chunks hand on
        h = (chunks + carried.unsqueeze(2)).reshape(b, -1, h.shape[-1])[:, :s]
        return self.down(h)


def _chunks(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = ChunkPadded()
    sharded = autotp.parallelize(model, (torch.randn(2, 16, 16),))
    assert sharded.autotp_plan.replicated_ops == [] and sharded.autotp_plan.params["up.weight"] == "S(0)"
    for seq in (16, 24, 11, 1, 3, 16):  # multiples of the chunk, then lengths the first capture's guard excluded
        x = torch.randn(2, seq, 16)
        torch.testing.assert_close(sharded(x), model(x), **TOL, msg=lambda m, s=seq: f"seq {s}: {m}")
    assert 1 <= len(sharded.autotp_programs.others) <= 3  # a program per guard a length failed (11, and 1 or 3)
    refusing = autotp.parallelize(model, (torch.randn(2, 16, 16),), recaptures=0)
    with pytest.raises(InputStructureError, match=r"fail a guard of the capture \(Guard failed: .*x\.size\(\)\[1\]"):
        refusing(torch.randn(2, 11, 16))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))  # FSDP2's shards: no second program shares them
    data_parallel = autotp.parallelize(model, (torch.randn(2, 16, 16),), mesh=mesh)
    with pytest.raises(InputStructureError, match="FSDP2 shards this program's parameters over 'dp'"):
        data_parallel(torch.randn(2, 11, 16))


def test_a_chunk_padded_layer_runs_lengths_the_capture_excluded():
    run_ranks(2, _chunks)


def _state_space(rank: int, world: int, family: str) -> None:
    """Lengths the first capture's guard excluded get programs of their own, forward and backward alike."""
    import transformers

    torch.manual_seed(0)
    built = {"mamba2": ("Mamba2ForCausalLM", configs.mamba2), "bamba": ("BambaForCausalLM", configs.bamba)}
    cls, config = built[family]
    model = getattr(transformers, cls)(config()).eval()
    sharded = autotp.parallelize(model, (torch.randint(0, 100, (2, 16)),), {"use_cache": False})
    for seq in (16, 11, 24, 5):
        ids = torch.randint(0, 100, (2, seq))
        mine, theirs = (m(ids, use_cache=False).logits for m in (sharded, model))
        torch.testing.assert_close(mine, theirs, **TOL, msg=lambda m, s=seq: f"seq {s}: {m}")
        for logits in (mine, theirs):
            logits.logsumexp(-1).mean().backward()
        grads = autotp.full_state_dict(sharded, grads=True)
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m, n=name, s=seq: f"seq {s} {n}: {m}")
        sharded.zero_grad(), model.zero_grad()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mamba2", "bamba"])  # Mamba-2 alone; a hybrid of Mamba-2 and attention
def test_state_space_layers_at_lengths_that_are_not_a_multiple_of_their_chunk(family):
    run_ranks(2, _state_space, family)
