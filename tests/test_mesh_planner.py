"""The mesh planner: tp x pp x dp, micro-batches, schedule and stage boundaries (estimates, meta device)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from autotp.cost_models import load_topology
from autotp.cost_models.schedule_tables import balance_stages
from autotp.passes.prepared_graph import prepared_graph
from autotp.planning.mesh_search import plan_mesh, plan_mesh_for_graph
from autotp.planning.solution import PlanningError
from tests.helpers import configs

LAYERS = 96
A100_LIMIT = 0.9 * 80e9


@pytest.fixture(scope="module")
def gpt3():
    """GPT-3 175B's shape (Brown et al. 2020; Narayanan et al. 2021 Table 1): 96 layers, hidden 12288,
    96 heads, sequence 2048, vocabulary padded to 51200; bf16 weights (fp32 Adam state is counted)."""
    from transformers import GPT2LMHeadModel

    config = configs.gpt2(
        n_layer=LAYERS,
        n_embd=12288,
        n_head=96,
        n_positions=2048,
        vocab_size=51200,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    )
    with torch.device("meta"):
        model = GPT2LMHeadModel(config).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    assert 174e9 < params < 176e9
    return prepared_graph(model, (torch.zeros(2, 2048, dtype=torch.long, device="meta"),), None, fold=True)


def _covers(stages: list, blocks: int) -> bool:
    return [b for start, end in stages for b in range(start, end)] == list(range(blocks))


def test_gpt3_175b_on_128_dgx_a100_with_ddp_chooses_megatrons_layout(gpt3):
    """Narayanan et al. 2021 trained this model on 1024 A100s (128 DGX A100) as TP 8 x PP 8 x DP 16 with a global
    batch of 1536; the planner, given the same cluster, batch and replicated (DDP) optimizer state, chooses it."""
    result = plan_mesh_for_graph(gpt3, topology="dgx-a100", nodes=128, global_batch=1536, data_parallel="ddp")
    c = result.choice
    assert (c.tp, c.pp, c.dp) == (8, 8, 16), result.to_dict()["choice"]
    assert c.memory_bytes <= A100_LIMIT
    assert _covers(c.stages, LAYERS) and len(c.stages) == c.pp * c.virtual_stages
    sizes = [end - start for start, end in c.stages]
    assert max(sizes) - min(sizes) <= 2  # balanced: the embedding and the head make their stages lighter
    assert 0.25 <= c.mfu <= load_topology("dgx-a100").products.peak_fraction  # Megatron: 33.7% MFU, 44.9% hw
    assert all(x.tp <= 8 for x in result.candidates)  # every TP group inside one node


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_gpt3_175b_as_megatron_ran_it_is_priced_near_its_measured_time(gpt3, schedule, virtual):
    """Like with like: Megatron's run as it ran -- TP 8 x PP 8 x DP 16, micro-batches of 1, every block
    recomputed, no sequence parallelism -- priced by the planner, against the step time its measured 140
    TFLOP/s per GPU give for the FLOPs it did (Narayanan et al. 2021: 96 B s L h^2 (1 + s/6h + V/16Lh) a step,
    forward, backward and the recomputed forward): 31.5 s.  The estimate may be faster (GEMMs at the profile's
    efficiency, no kernel-launch or straggler time): at most 30% faster (the shape-aware product model prices these
    GEMMs at A100's published MAMF, about 80% of peak, where Megatron's whole step reached 45%), at most 25% slower."""
    from autotp.cost_models.mesh_layout import Candidate, Setting, price
    from autotp.cost_models.pricing import model_flops, priced_unit
    from autotp.planning.tp_profiles import tp_profile

    unit, sizes = priced_unit(gpt3)
    topo = load_topology("dgx-a100", nodes=128)
    flops = 96 * 1536 * 2048 * LAYERS * 12288**2 * (1 + 2048 / (6 * 12288) + 51200 / (16 * LAYERS * 12288))
    measured = flops / (1024 * 140e12)
    setting = Setting(topo, 1536, True, "ddp", A100_LIMIT, model_flops(gpt3, sizes) / unit * 1536)
    megatron = price(
        tp_profile(gpt3, 8, topo, True, sizes, unit),
        Candidate(8, 8, 16, microbatch_size=1, schedule=schedule, virtual_stages=virtual, recompute=True),
        setting,
    )
    assert megatron.fits, megatron.note  # it ran in 80 GB
    assert 0.70 * measured <= megatron.step_seconds <= 1.25 * measured, (megatron.step_seconds, measured)


def test_gpt3_175b_with_fsdp_fits_wherever_ddp_does(gpt3):
    ddp = plan_mesh_for_graph(gpt3, topology="dgx-a100", nodes=128, global_batch=1536, data_parallel="ddp")
    fsdp = plan_mesh_for_graph(gpt3, topology="dgx-a100", nodes=128, global_batch=1536, data_parallel="fsdp")
    assert fsdp.choice.memory_bytes <= A100_LIMIT
    # sharding state only ever needs less memory: every DDP layout that fits has an FSDP twin that fits
    fits = {(x.tp, x.pp, x.dp) for x in fsdp.candidates if x.fits}
    assert {(x.tp, x.pp, x.dp) for x in ddp.candidates if x.fits} <= fits
    assert fsdp.to_dict()["choice"]["tp"] == fsdp.choice.tp


def test_zero_bubble_schedules_are_priced_and_chosen_where_they_win(gpt3):
    """Megatron's layout of GPT-3 on 128 DGX A100 runs 96 micro-batches over 8 stages: a zero-bubble schedule
    (its own table: input and weight gradients apart) leaves less idle time than interleaved 1F1B on the same
    layout, and the planner takes it."""
    from dataclasses import replace

    from autotp.cost_models.mesh_layout import Setting, price
    from autotp.cost_models.pricing import model_flops, priced_unit
    from autotp.planning.tp_profiles import tp_profile

    result = plan_mesh_for_graph(gpt3, topology="dgx-a100", nodes=128, global_batch=1536, data_parallel="ddp")
    c = result.choice
    assert c.schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"), c.schedule
    topo = load_topology("dgx-a100", nodes=128)
    unit, sizes = priced_unit(gpt3)
    profile = tp_profile(gpt3, c.tp, topo, True, sizes, unit, c.sequence_parallel, c.selective)
    setting = Setting(topo, 1536, True, "ddp", A100_LIMIT, model_flops(gpt3, sizes) / unit * 1536)
    interleaved = price(profile, replace(c, schedule="Interleaved1F1B", stages=[], step_seconds=None), setting)
    assert interleaved.bubble > c.bubble > 0 and interleaved.step_seconds > c.step_seconds
    assert price(profile, replace(c, stages=[], step_seconds=None), setting).step_seconds == c.step_seconds


def test_activations_per_layer_lie_within_korthikantis_bounds(gpt3):
    """The planner counts kept op outputs on the graph; Korthikanti et al. 2022 (TP t, bf16, dropout masks):
    sbh(10 + 24/t) without the attention-score terms (fused SDPA), sbh(10 + 24/t + 5as/(ht)) with them."""
    from autotp.cost_models.pricing import priced_unit
    from autotp.planning.tp_profiles import tp_profile

    unit, sizes = priced_unit(gpt3)
    profile = tp_profile(gpt3, 8, load_topology("dgx-a100", nodes=128), True, sizes, unit)
    s, h, a, t = 2048, 12288, 96, 8
    per_layer = profile.blocks[LAYERS // 2].memory["activations"]
    assert s * h * (10 + 24 / t) <= per_layer <= s * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert profile.boundary == s * h * 2  # a stage hands on one bf16 hidden state per token


def test_whole_block_recomputation_under_sequence_parallelism_keeps_each_layers_tokens(gpt3):
    """Korthikanti et al. 2022 (§4.3, Table 2): with sequence parallelism and full recomputation a layer keeps
    only its input, split over the t ranks: 2sbh/t bytes (bf16)."""
    from autotp.cost_models.mesh_layout import KEPT, Candidate, Profile, Section, stage_memory
    from autotp.cost_models.pricing import priced_unit
    from autotp.planning.tp_profiles import tp_profile

    unit, sizes = priced_unit(gpt3)
    s, h, t = 2048, 12288, 8
    split = tp_profile(gpt3, t, load_topology("dgx-a100", nodes=128), True, sizes, unit, tokens=True)
    assert split.sequence_parallel
    # the activations alone (no weights or optimizer state), one sample, no pipeline
    kept = Profile(
        t,
        [Section(x.seconds, {k: v for k, v in x.memory.items() if k in KEPT}) for x in split.sections],
        split.boundary,
        True,
        sequence_parallel=True,
    )
    layout = Candidate(t, 1, 1, microbatch_size=1, recompute=True, sequence_parallel=True)
    two, four = (stage_memory(kept, [(1, 1 + n)], 0, layout, 1, "ddp")[0].total for n in (2, 4))
    assert (four - two) / 2 == pytest.approx(2 * s * h / t)


@pytest.fixture(scope="module")
def small_llama():
    """(8-layer LLaMA graph, bytes of its fp32 training state), captured once."""
    from transformers import LlamaForCausalLM

    config = configs.llama(vocab_size=256, intermediate_size=128, num_hidden_layers=8, max_position_embeddings=2048)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = 16 * sum(p.numel() for p in model.parameters())  # fp32 weights, grads, Adam m and v
    return prepared_graph(model, (torch.zeros(1, 16, dtype=torch.long, device="meta"),), None, fold=True), state


@pytest.fixture(scope="module")
def one_gpu_nodes(tmp_path_factory):
    """A cluster of one-GPU nodes, written as a file that extends a known node: no TP to split with."""
    path = tmp_path_factory.mktemp("topo") / "single-gpu-nodes.json"
    path.write_text(
        json.dumps(
            {
                "name": "single-gpu-nodes",
                "extends": "dgx-h100",
                "figures": {
                    "gpus_per_node": {"value": 1, "source": "test: one H100 per node"},
                    "nics_per_node": {"value": 1, "source": "test: one NIC per node"},
                },
            }
        )
    )
    return str(path)


def test_a_model_that_does_not_fit_one_device_gets_pipeline_stages(small_llama, one_gpu_nodes):
    gm, state = small_llama
    result = plan_mesh_for_graph(
        gm, topology=one_gpu_nodes, nodes=2, global_batch=2, data_parallel="ddp", memory_limit=0.75 * state
    )
    c = result.choice
    assert (c.tp, c.pp, c.dp) == (1, 2, 1) and c.schedule is not None
    assert _covers(c.stages, 8)
    replicated = next(x for x in result.candidates if x.pp == 1)
    assert not replicated.fits and "over the" in replicated.note


def test_a_request_that_cannot_fit_says_what_would(small_llama, one_gpu_nodes):
    gm, state = small_llama
    with pytest.raises(PlanningError, match="nothing fits") as error:
        plan_mesh_for_graph(
            gm, topology=one_gpu_nodes, nodes=2, global_batch=2, data_parallel="ddp", memory_limit=0.2 * state
        )
    devices = int(re.search(r"(\d+) devices \(nodes=\d+\) fit", str(error.value)).group(1))
    assert devices > 2
    again = plan_mesh_for_graph(
        gm, topology=one_gpu_nodes, nodes=devices, global_batch=2, data_parallel="ddp", memory_limit=0.2 * state
    )
    assert again.choice.fits  # the advice holds


def test_clusters_from_a_node_and_a_count(tmp_path):
    assert load_topology("dgx-a100", nodes=128).devices == 1024
    path = tmp_path / "pod.json"
    path.write_text(
        json.dumps(
            {"name": "pod", "extends": "dgx-a100", "figures": {"nodes": {"value": 4, "source": "test: four nodes"}}}
        )
    )
    assert load_topology(str(path)).devices == 32
    with pytest.raises(ValueError, match="nodes must be a positive integer"):
        load_topology("dgx-a100", nodes=0)
    with pytest.raises(ValueError, match=r"give nodes=4 \(--nodes\)"):  # checked before anything is captured
        plan_mesh(torch.nn.Linear(2, 2), (torch.zeros(1, 2),), topology="dgx-a100", devices=32)
    box = tmp_path / "box.json"
    box.write_text(
        json.dumps(
            {
                "name": "box",
                "extends": "pcie-a100",
                "figures": {"nics_per_node": {"value": 0, "source": "test: no network"}},
            }
        )
    )
    with pytest.raises(ValueError, match="no NICs"):
        load_topology(str(box), nodes=2)


def test_stage_balance():
    assert balance_stages([1.0] * 96, 8) == [(i * 12, i * 12 + 12) for i in range(8)]
    costs = [3.0, 1, 1, 1, 1, 3.0]
    stages = balance_stages(costs, 3)
    assert _covers(stages, 6) and max(sum(costs[a:b]) for a, b in stages) == 4  # the best largest stage
    assert len(balance_stages([5.0, 1, 1, 1], 4)) == 4  # every stage gets a block even when one dominates
    with pytest.raises(ValueError, match="at most 4 stages"):
        balance_stages([1.0] * 4, 5)


def _memory_fits(per_block: list, limit: float, parts: int):
    """1F1B-like memory: a stage holds its blocks' bytes times the micro-batches in flight (parts - stage)."""
    return lambda stage, start, end: sum(per_block[start:end]) * (parts - stage) <= limit


def test_stage_boundaries_balance_time_under_the_memory_limit():
    costs = [1.0] * 8
    assert balance_stages(costs, 2) == [(0, 4), (4, 8)]
    # the time-balanced first stage holds 4 blocks x 2 in flight = 8 > 6: a block moves to the last stage
    assert balance_stages(costs, 2, _memory_fits([1.0] * 8, 6, 2)) == [(0, 3), (3, 8)]
    assert balance_stages(costs, 2, _memory_fits([1.0] * 8, 8, 2)) == [(0, 4), (4, 8)]  # ample: time decides
    assert balance_stages(costs, 2, _memory_fits([1.0] * 8, 5, 2)) is None  # 2 + 5 blocks at most: none fits


def test_stage_boundaries_are_the_best_that_fit():
    """Against every split of a few blocks: the slowest stage is the fastest any fitting split achieves."""
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 7)
        parts = rng.randint(1, n)
        costs = [rng.choice([0.5, 1.0, 2.0, 3.0]) for _ in range(n)]
        fits = _memory_fits([rng.choice([1.0, 2.0, 4.0]) for _ in range(n)], rng.choice([4.0, 8.0, 12.0]), parts)
        splits = [
            list(zip((0, *cuts), (*cuts, n), strict=True)) for cuts in itertools.combinations(range(1, n), parts - 1)
        ]
        fitting = [r for r in splits if all(fits(k, a, b) for k, (a, b) in enumerate(r))]
        found = balance_stages(costs, parts, fits)
        if not fitting:
            assert found is None
            continue
        assert found in fitting
        assert max(sum(costs[a:b]) for a, b in found) == min(max(sum(costs[a:b]) for a, b in r) for r in fitting)


def _section(params: float):
    from autotp.cost_models.mesh_layout import Section

    return Section(1.0, {"params": params, "grads": params, "optimizer": 2 * params})


def test_fsdp_is_priced_as_the_runtime_builds_it_one_unit_per_block():
    """FSDP2 per block (parallel/data.py): everything sharded over dp; the root unit (embedding, head) gathered all
    step; the running block's parameters gathered with its all-gather output and the next one's (prefetched), the
    running one's gradient whole with its reduce-scatter input.  In a pipeline stage (reshard_after_forward=False)
    all of it stays gathered."""
    from autotp.cost_models.mesh_layout import Candidate, Profile, stage_memory

    profile = Profile(1, [_section(10), *(_section(4) for _ in range(4)), _section(6)], boundary=0.0, stackable=True)
    state = 4 * (10 + 4 * 4 + 6)  # parameters, gradients and Adam's two moments
    alone = stage_memory(profile, [(0, 4)], 0, Candidate(1, 1, 2, microbatch_size=1), 1, "fsdp")[0]
    assert alone.total == state / 2 + 2 * (10 + 6) + 3 * 4 + 2 * 4
    assert alone.gathered_parameters == 10 + 6 + 3 * 4  # running, its kept all-gather output, the prefetched one
    assert stage_memory(profile, [(0, 4)], 0, Candidate(1, 1, 2, microbatch_size=1), 1, "ddp")[0].total == state
    staged = Candidate(1, 2, 2, microbatch_size=1, schedule="1F1B")
    held = 2 * 4 + 6  # two blocks and the head
    in_stage = stage_memory(profile, [(2, 4)], 1, staged, 2, "fsdp")[0]
    assert in_stage.total == held + held + (held + held + 2 * held) / 2
    assert (in_stage.gathered_parameters, in_stage.gathered_gradients, in_stage.parameters) == (held, held, held / 2)


def test_a_tied_embedding_is_priced_on_the_first_and_the_last_stage():
    """GPT-2 ties its input and output embeddings: a pipeline's first and last stages each hold the vocabulary x
    hidden table with its gradient and Adam state (Megatron's embedding group); a stage holding both, one copy."""
    import dataclasses

    from transformers import GPT2LMHeadModel

    from autotp.cost_models.mesh_layout import Candidate, stage_memory
    from autotp.cost_models.pricing import priced_unit
    from autotp.parallel.stages import block_profile, find_blocks
    from autotp.planning.tp_profiles import tp_profile

    vocab, hidden = 512, 64
    profiles = {}
    for tied in (True, False):
        config = configs.gpt2(n_layer=6, n_embd=hidden, vocab_size=vocab, n_positions=32, tie_word_embeddings=tied)
        with torch.device("meta"):
            model = GPT2LMHeadModel(config)
        gm = prepared_graph(model, (torch.zeros(1, 16, dtype=torch.long, device="meta"),), None, fold=True)
        unit, sizes = priced_unit(gm)
        profiles[tied] = tp_profile(gm, 1, load_topology("dgx-h100"), True, sizes, unit)
        assert profiles[tied].tied.get("params", 0.0) == (vocab * hidden * 4 if tied else 0.0)
        assert block_profile(gm, find_blocks(model)).tied == profiles[tied].tied  # the stage splitter's pricing
    profile = profiles[True]
    without = dataclasses.replace(profile, tied={}, sums={})
    table = vocab * hidden * (4 + 4 + 8)  # fp32 weight, gradient, Adam's two moments
    layouts = [
        (Candidate(1, 2, 1, microbatch_size=1, schedule="1F1B"), [(3, 6)], 1, table),  # the head's stage
        (Candidate(1, 2, 1, microbatch_size=1, schedule="1F1B"), [(0, 3)], 0, 0.0),  # the embedding's
        (
            Candidate(1, 2, 1, microbatch_size=1, schedule="ZBVZeroBubble", virtual_stages=2),
            [(0, 1), (5, 6)],
            0,
            table,
        ),  # a V: rank 0 holds both end stages, each its own copy
        (Candidate(1, 1, 1, microbatch_size=1), [(0, 6)], 0, 0.0),
    ]  # one stage: one copy
    for layout, ranges, rank, extra in layouts:
        got = (
            stage_memory(profile, ranges, rank, layout, 4, "ddp")[0].total
            - stage_memory(without, ranges, rank, layout, 4, "ddp")[0].total
        )
        assert got == pytest.approx(extra), (layout.schedule, ranges)
