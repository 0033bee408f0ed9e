"""Where pipeline stages begin and what each passes on: block profiles priced per stage, stage starts under a
memory limit, stages built alone that chain into the model, and the refusals."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from autotp.cost_models import load_topology
from autotp.cost_models.mesh_layout import Candidate, Setting, stage_memory
from autotp.parallel.split import stage_graph
from autotp.parallel.stages import StageError, block_profile, find_blocks, stage_starts
from autotp.passes.prepared_graph import prepared_graph
from tests.helpers import configs
from tests.helpers.training import SEQ, VOCAB, llama, token_loss


def _starts(profile, stages: int = 2, limit: float = math.inf) -> list:
    """1F1B over ``stages`` ranks, 4 micro-batches of 1 sample."""
    return stage_starts(
        profile,
        Candidate(1, stages, 1, microbatch_size=1, schedule="1f1b"),
        Setting(load_topology(None), 4, True, "fsdp", limit, 0.0),
    )


def test_block_profiles_price_blocks_alike_and_the_head_on_the_last_stage(tmp_path):
    """Priced on a device whose products cost their FLOPs alone (at these toy sizes an H100's products all cost
    about one kernel's overhead, whatever their size), so that a larger vocabulary makes a heavier head."""
    flat = tmp_path / "flat.json"
    flat.write_text(
        '{"name": "flat", "extends": "dgx-h100", "figures": {}, "products": {"peak_fraction": {"value": '
        '0.7, "source": "test: FLOPs alone"}, "points": []}}'
    )
    x = torch.randint(0, VOCAB, (2, SEQ))
    model = llama(layers=5)
    fold = find_blocks(model)
    assert (fold.path, fold.count) == ("model.layers", 5)
    gm = prepared_graph(model, (x,), None)
    whole = block_profile(gm, fold, topology=flat)
    folded = block_profile(prepared_graph(model, (x,), None, fold=True), fold, topology=flat)  # blocks 0, 1, 3, 4
    for a, b in zip(whole.sections, folded.sections, strict=True):
        assert a.seconds == pytest.approx(b.seconds)
        assert a.memory == pytest.approx(b.memory)
    assert len({s.seconds for s in whole.blocks}) == 1
    block = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    assert whole.blocks[0].memory["params"] == block and whole.blocks[0].memory["optimizer"] == 2 * block
    assert block_profile(gm, fold, tp=2, topology=flat).blocks[0].memory["params"] == block / 2
    first, last = whole.sections[0].seconds, whole.sections[-1].seconds
    assert first < whole.blocks[0].seconds < last * 100
    big_head = block_profile(prepared_graph(llama(layers=5, vocab=4096), (x,), None, fold=True), fold, topology=flat)
    assert big_head.sections[-1].seconds > 4 * last
    assert big_head.sections[0].seconds == pytest.approx(first, rel=0.5)
    small, large = _starts(whole), _starts(big_head)
    assert large[1] > small[1], (small, large)  # a heavier head leaves fewer blocks on the last stage
    with pytest.raises(StageError, match="6 pipeline stages need at least 6 blocks"):
        _starts(whole, stages=6)
    # 1F1B: the first stage holds two micro-batches in flight, the last one; under a limit the time-balanced
    # split overflows on the first stage, a block moves to the last
    k = small[1]
    balanced, later = [(0, k), (k, 5)], [(0, k - 1), (k - 1, 5)]
    limit = max(_stage_peaks(whole, later))
    assert _stage_peaks(whole, balanced)[0] > limit
    assert _starts(whole, limit=limit) == [0, k - 1]
    assert _starts(whole, limit=max(_stage_peaks(whole, balanced))) == small  # enough memory: time alone decides
    with pytest.raises(StageError, match=r"no split of the 5 blocks into 2 stages fits .* more pipeline stages"):
        _starts(whole, limit=min(max(_stage_peaks(whole, r)) for r in (balanced, later)) / 2)


def _stage_peaks(profile, ranges: list) -> list:
    layout = Candidate(1, 2, 1, microbatch_size=1, schedule="1f1b")
    return [stage_memory(profile, [r], i, layout, 4, "fsdp")[0].total for i, r in enumerate(ranges)]


def test_a_model_without_repeated_blocks_is_refused():
    with pytest.raises(StageError, match="no list of identical blocks"):
        find_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4)))


class _SkipOver(torch.nn.Module):
    """Blocks between an embedding and a head that reads the embedding again: a value the middle stages skip."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3)
        )
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        e = self.embed(x)
        h = e
        for block in self.blocks:
            h = h + block(h)
        return self.head(h * e)


def _chain(model, x, path: str, starts: list) -> tuple:
    """Each stage built on its own, then run one after the other: (output, stages)."""
    bounds = [*starts, len(model.get_submodule(path))]
    stages = [stage_graph(model, (x,), {}, path, bounds[-1], a, b) for a, b in itertools.pairwise(bounds)]
    values = (x,)
    for stage in stages:
        values = tuple(stage.graph(*values))
    return values, stages


def test_stages_pass_on_what_later_stages_read():
    """A head that reads the embedding again: the stages in between pass it on; one-block stages included."""
    torch.manual_seed(0)
    model, x = _SkipOver(), torch.randn(2, 8)
    (out,), stages = _chain(model, x, "blocks", [0, 1, 2])
    assert [n for st in stages for n, _ in st.graph.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [len(st.args) for st in stages] == [1, 2, 2]  # the stream and the embedding's output
    torch.testing.assert_close(out, model(x))


def test_stages_built_alone_chain_into_the_model():
    """LLaMA (rotary tables and sizes passed between stages), GPT-2 (tied embeddings: both end stages hold the
    weight under both its names) and Mixtral (export shares size arithmetic between the blocks' experts: made again
    after the cut) cut into stages (LLaMA into two and three, the others into three, one of them in the middle),
    each captured without the others' blocks, chain into exactly the model's logits, at another batch and sequence
    length than they were captured at."""
    from transformers import GPT2LMHeadModel, MixtralForCausalLM

    gpt2 = GPT2LMHeadModel(
        configs.gpt2(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=4, bos_token_id=0, eos_token_id=0)
    ).eval()
    mixtral = MixtralForCausalLM(
        configs.mixtral(vocab_size=VOCAB, num_hidden_layers=4, max_position_embeddings=131072)
    ).eval()
    x = torch.randint(0, VOCAB, (2, SEQ))
    other = torch.randint(0, VOCAB, (3, 5))
    cuts = {"llama": ([0, 2], [0, 1, 3]), "mixtral": ([0, 1, 3],), "gpt2": ([0, 1, 3],)}
    for name, model, path in [
        ("llama", llama().eval(), "model.layers"),
        ("mixtral", mixtral, "model.layers"),
        ("gpt2", gpt2, "transformer.h"),
    ]:
        for starts in cuts[name]:
            bounds = [*starts, 4]
            stages = [stage_graph(model, (x,), {}, path, 4, a, b) for a, b in itertools.pairwise(bounds)]
            values = (other,)
            for stage in stages:
                values = tuple(stage.graph(*values))
            assert torch.equal(values[0], model(other).logits), (path, starts)
    names = {n for n, _ in stages[0].graph.named_parameters(remove_duplicate=False)}
    assert {"transformer.wte.weight", "lm_head.weight"} <= names
    assert stages[0].outside["lm_head.weight"] == {"pre", "post"}  # read by the embedding and by the head


def test_a_graph_captured_from_a_view_runs_on_any_tensor():
    """torch.export guards a view input on its base; pipelining's stages receive detached tensors (no base)."""
    from autotp.passes.capture import capture

    model = llama(layers=1)
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1))
    gm = capture(model, (tokens[:, :-1].chunk(2)[0],))  # a training loop's inputs: a slice of a micro-batch
    x = tokens[:2, :-1].clone()
    torch.testing.assert_close(gm(x.detach())[0], model(x).logits)


class _OneRankOfTwo:
    """The "pp" dimension of a 2-stage mesh as pipeline() reads it before any communication."""

    mesh_dim_names, ndim = ("pp",), 1

    def __getitem__(self, name):
        return self

    def get_group(self):
        return None

    def size(self):
        return 2

    def get_local_rank(self):
        return 0


def test_parallelize_chooses_stages_under_its_memory_limit():
    import autotp

    x = torch.randint(0, VOCAB, (2, SEQ))
    with pytest.raises(StageError, match="no split of the 4 blocks into 2 stages fits 1e-06 GB"):
        autotp.parallelize(llama(), (x,), mesh=_OneRankOfTwo(), loss_fn=token_loss, memory_limit=1e3)
