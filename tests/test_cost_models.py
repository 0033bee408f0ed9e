"""Cost model: figures with sources, collective times against published measurements, memory,
Megatron's traffic formula, and clear errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import autotp
from autotp.cost_models import collective_time, load_topology, reshard_time
from autotp.cost_models.communication import OPS
from autotp.cost_models.compute import op_time, product_time
from autotp.cost_models.memory import state_factor
from autotp.cost_models.topology import PROFILES, profile_names
from autotp.planning.solution import PlanningError
from tests.helpers.models import build

GiB = 2**30


def test_profiles_cover_the_common_machines_and_every_figure_has_a_source():
    assert {"dgx-a100", "dgx-h100", "dgx-h200", "dgx-b200", "pcie-a100", "2x-dgx-h100"} <= set(profile_names())
    for name in profile_names():
        raw = json.loads((PROFILES / f"{name}.json").read_text())
        assert all(entry["source"] for entry in raw["figures"].values()), name
        topo = load_topology(name)
        assert topo.memory_bytes > 0 and topo.peak_flops > 0 and topo.hbm_bandwidth > 0


def test_user_profile_by_path_and_malformed_files(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(
        json.dumps(
            {"name": "mine", "extends": "dgx-h100", "figures": {"memory_bytes": {"value": 40e9, "source": "my card"}}}
        )
    )
    mine = load_topology(path)
    assert mine.memory_bytes == 40e9 and mine.intra_busbw == load_topology("dgx-h100").intra_busbw
    path.write_text(json.dumps({"name": "bad", "figures": {"memory_bytes": {"value": 1}}}))
    with pytest.raises(ValueError, match="needs a 'value' and a 'source'"):
        load_topology(path)
    path.write_text("{oops")
    with pytest.raises(ValueError, match="cannot read topology"):
        load_topology(path)
    with pytest.raises(FileNotFoundError, match="dgx-h100"):
        load_topology("no-such-machine")


def test_one_gib_all_reduce_on_eight_h100s_matches_measurements():
    seconds = collective_time("all_reduce", GiB, 8, load_topology("dgx-h100"))
    assert 3.5e-3 <= seconds <= 5.5e-3  # ~4-5 ms measured (nccl-tests#212, nccl#1455)


def test_across_nodes_costs_more():
    two_nodes = load_topology("2x-dgx-h100")
    inside = collective_time("all_reduce", GiB, 8, two_nodes)
    across = collective_time("all_reduce", GiB, 16, two_nodes)
    assert across >= 1.5 * inside
    small_inside = collective_time("all_reduce", 32 * 1024, 8, two_nodes)
    small_across = collective_time("all_reduce", 32 * 1024, 16, two_nodes)
    assert 20e-6 <= small_across and small_across >= 3 * small_inside  # ~45 us across nodes (nccl#1244)


def test_all_to_all_across_nodes_pays_for_the_network():
    """An all-to-all's buffer (what one rank sends) leaves the node in the share its off-node peers get, through
    NICs its node's GPUs share: 58.7 MB per rank over 2 x 8 H100s sends half of it at 46 GB/s per GPU (at least
    0.64 ms); inside one node it stays on NVLink; more nodes send more of it off-node."""
    two_nodes = load_topology("2x-dgx-h100")
    nbytes = 58.7e6
    inside, across = (
        collective_time("all_to_all", nbytes, 8, two_nodes),
        collective_time("all_to_all", nbytes, 16, two_nodes),
    )
    nic = two_nodes.nic_bandwidth * two_nodes.nics_per_node / two_nodes.gpus_per_node
    assert across >= nbytes / 2 / nic and across >= 3 * inside, (inside, across)
    assert inside <= 7 / 8 * nbytes / two_nodes.intra_busbw * 1.1
    many = dataclasses.replace(two_nodes, nodes=32)
    assert collective_time("all_to_all", nbytes, 256, many) >= 248 / 256 * nbytes / nic > across


@pytest.mark.parametrize("op", OPS)
def test_small_messages_cost_microseconds_and_time_grows_with_bytes(op):
    topo = load_topology("dgx-h100")
    small = collective_time(op, 4096, 8, topo)
    assert 1e-6 <= small <= 50e-6
    assert collective_time(op, 64 * 2**20, 8, topo) > small
    assert collective_time(op, GiB, 1, topo) == 0.0


def test_collective_errors():
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time("all_sum", 1, 2, load_topology())
    with pytest.raises(ValueError, match="does not fit"):
        collective_time("all_reduce", 1, 16, load_topology("dgx-h100"))


def test_every_cost_function_takes_a_topology_as_parallelize_does():
    """A profile name, a path (str or Path) and a loaded profile price the same; a bad name says which exist."""
    from autotp.placement import Partial, Replicate

    path = PROFILES / "dgx-h100.json"
    calls = [
        lambda t: collective_time("all_reduce", GiB, 8, t),
        lambda t: op_time(1e12, 1e9, t),
        lambda t: reshard_time(Partial(), Replicate(), GiB, 8, t),
    ]
    for call in calls:
        assert call("dgx-h100") == call(str(path)) == call(path) == call(load_topology("dgx-h100")) == call(None)
        assert call("dgx-a100") != call("dgx-h100")
        with pytest.raises(FileNotFoundError, match=r"unknown topology 'dgx-h1000'.*dgx-h100"):
            call("dgx-h1000")


def test_a_fused_collective_matmul_costs_the_longer_of_the_two_plus_a_tail():
    """Asynchronous TP (one chunk per rank): max(collective, product) + min / n + (n - 1) NVLink steps; no faster
    than the longer of the two, slower than their sum only where a chunk is shorter than a step."""
    from autotp.cost_models.communication import fused_time

    topo = load_topology("dgx-h100")
    gather = collective_time("all_gather", 64 * 2**20, 8, topo)  # 64 MiB of tokens to 8 H100s
    product = product_time(8192, 4096, 4096, topo)  # the column-parallel product they feed
    fused = fused_time(gather, product, 8, topo)
    assert fused == pytest.approx(max(gather, product) + min(gather, product) / 8 + 7 * topo.intra_step_latency_s)
    assert max(gather, product) < fused < gather + product
    assert fused_time(gather, product, 1, topo) == gather + product
    tiny = 1e-7  # chunks shorter than a step: fusing does not pay
    assert fused_time(tiny, tiny, 8, topo) > 2 * tiny
    assert fused_time(gather, product, 8, "dgx-h100") == fused


def test_roofline_compute():
    """Elementwise ops are priced by their bytes; a product that moves more than it computes, by its bytes too."""
    topo = load_topology("dgx-h100")
    copy = op_time(1e6, 1e9, topo)
    assert copy == pytest.approx(1e9 / (topo.hbm_bandwidth * topo.memory_efficiency))
    vector = product_time(1, 8192, 8192, topo, nbytes=2 * 8192**2)  # a matrix-vector product reads the matrix
    assert vector == pytest.approx(2 * 8192**2 / (topo.hbm_bandwidth * topo.memory_efficiency))


def test_views_cost_nothing():
    """A view's output aliases its input: reshaping and transposing around a product leaves the estimate as is."""

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 64))

        def forward(self, x):
            return x @ self.w

    class Viewed(Plain):
        def forward(self, x):
            y = x.view(x.shape[0], 8, 8).transpose(1, 2).transpose(1, 2).reshape(x.shape[0], 64)
            return (y @ self.w).unsqueeze(0).squeeze(0)

    x = torch.randn(256, 64)
    costs = [
        autotp.plan(model, (x,), world_size=2, training=False, fold=False).cost["seconds"]
        for model in (Plain(), Viewed())
    ]
    assert costs[1] == pytest.approx(costs[0], rel=1e-4), costs  # (the solver breaks ties by 0.1 ns an option)


def test_training_state_is_sixteen_bytes_a_parameter():
    assert state_factor(2, True) * 2 == 16  # ZeRO paper: mixed-precision Adam
    assert state_factor(4, True) * 4 == 16
    assert state_factor(2, False) == 1


def test_per_layer_traffic_is_megatrons():
    """Forward + backward all-reduce traffic of one block is 8·b·s·h·(t−1)/t elements a device."""
    model, args, _ = build("gpt2", device="meta")
    world = 4
    plan = autotp.plan(model, args, world_size=world)
    b, s = args[0].shape
    h = model.config.n_embd
    # the block's own collectives and its submodules' (a residual add kept partial reduces at block level)
    elements = sum(
        2 * (world - 1) / world * c["bytes"] / 4
        for c in plan.collectives
        if c["op"] == "all_reduce" and f"{c['module']}.".startswith("transformer.h.0.")
    )
    assert elements == pytest.approx(8 * b * s * h * (world - 1) / world)


def test_memory_limit_infeasible_says_what_fits():
    model, args, _ = build("llama", device="meta")
    free = autotp.plan(model, args, world_size=2)
    need = free.cost["memory"]["total"]
    with pytest.raises(PlanningError, match="try world size"):
        autotp.plan(model, args, world_size=2, memory_limit=need * 0.6)
    with pytest.raises(
        PlanningError,
        match=r"try world size (16|32) \(more than a node's 8 devices: `autotp mesh "
        r"MODEL --nodes (2|4)` lays out TP inside a node",
    ):
        autotp.plan(model, args, world_size=2, memory_limit=need * 2 / 14, topology="dgx-h100")
    inference = autotp.plan(model, args, world_size=2, training=False)
    assert "optimizer" not in inference.cost["memory"] and inference.cost["memory"]["kv_cache"] > 0


def test_an_all_to_all_across_nodes_sends_its_off_node_share_over_the_nics():
    """A rank's buffer goes 1/g to each rank: over 16 ranks of two DGX H100s, half of it leaves the node on the
    rank's own 400 Gb/s NIC (46 GB/s); inside one node it all moves over NVLink."""
    topo = load_topology("dgx-h100", nodes=32)
    sent = 58.7e6
    inside, across = (collective_time("all_to_all", sent, g, topo) for g in (8, 16))
    assert across >= sent / 2 / topo.nic_bandwidth  # at least the off-node half at one NIC's speed: 0.64 ms
    assert across > 2 * inside
    assert collective_time("all_to_all", sent, 256, topo) > across  # 31/32 of it off the node


def test_an_inference_plan_lists_nothing_of_a_backward():
    """training=False: no backward collectives, gradients, optimizer state or activations kept for a backward in the
    plan, its JSON or the CLI's tables (issue 35: inference prices inference); the training plan has them."""
    from rich.console import Console

    from autotp.plan import Plan
    from autotp.tools.report import print_plan

    model, args, _ = build("llama", device="meta")
    trained, served = (autotp.plan(model, args, world_size=2, training=t) for t in (True, False))
    assert {c["phase"] for c in trained.collectives} == {"forward", "backward"}
    assert {c["phase"] for c in served.collectives} == {"forward"}
    assert {"grads", "optimizer", "activations"} <= set(trained.cost["memory"])
    assert not {"grads", "optimizer", "activations"} & set(served.cost["memory"])
    assert not {"activations", "regathers", "recompute"} & set(served.cost)
    again = Plan.from_json(served.to_json())
    assert again.collectives == served.collectives and again.cost["memory"] == served.cost["memory"]
    console = Console(record=True, width=160)
    print_plan(served, console=console)
    text = console.export_text()
    assert "backward" not in text and "estimated forward time" in text
