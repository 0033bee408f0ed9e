"""A LLaMA-3-70B configuration on the meta device: memory per device and the choice of mesh."""

from __future__ import annotations

import pytest
import torch

from autotp.cost_models.pricing import Sizes
from autotp.options import PlanOptions
from autotp.passes.prepared_graph import prepared_graph
from autotp.planning.mesh_search import plan_mesh_for_graph
from autotp.planning.tensor_plan import solve_plan
from tests.helpers import configs

H, FFN, LAYERS, HEADS, KV, VOCAB = 8192, 28672, 80, 64, 8, 128256


@pytest.fixture(scope="module")
def llama70b():
    from transformers import LlamaForCausalLM

    config = configs.llama(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        max_position_embeddings=2048,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.zeros(8, 2048, dtype=torch.long, device="meta")  # the global batch the costs are priced at
    return prepared_graph(model, (ids,), None, fold=True)  # 80 blocks planned from four (passes/fold.py)


def test_parameter_bytes_at_tp8_match_the_analytic_figure(llama70b):
    plan = solve_plan(llama70b, 8, PlanOptions(topology="dgx-h100", training=False))
    kv_width = KV * (H // HEADS)
    sharded = 2 * VOCAB * H + LAYERS * (2 * H * H + 2 * H * kv_width + 3 * H * FFN)
    replicated = (2 * LAYERS + 1) * H  # RMSNorm weights
    analytic = 2 * (sharded / 8 + replicated)  # bf16
    assert plan.cost["memory"]["params"] == pytest.approx(analytic, rel=0.02)


def test_tp_inside_the_node_beats_tp_across_nodes(llama70b):
    """Why the mesh planner keeps TP inside a node: TP 16 over two DGX H100 is slower than TP 8 on half the batch."""
    batch = next(n for n in llama70b.graph.nodes if n.op == "placeholder").meta["val"].shape[0]
    half = Sizes({str(batch.node.expr): 4})
    across = solve_plan(llama70b, 16, PlanOptions(topology="2x-dgx-h100", training=False)).cost["seconds"]
    inside = solve_plan(llama70b, 8, PlanOptions(topology="2x-dgx-h100", training=False), sizes=half).cost["seconds"]
    assert inside < across
    result = plan_mesh_for_graph(llama70b, topology="dgx-h100", nodes=2, training=False)
    assert result.choice.tp == 8 and result.choice.tp * result.choice.pp * result.choice.dp == 16


@pytest.mark.slow
def test_long_sequences_on_one_node_plan_sequence_parallelism_and_recomputation():
    """Sequence 32768 on 8 x H100 (Korthikanti et al.'s regime): activations, not weights, decide; the
    planner also prices each TP size with sequence parallelism and selective recomputation, names the
    leanest layout (which uses both) and a device count that fits -- and that count does fit."""
    import re

    from transformers import LlamaForCausalLM

    from autotp.planning.solution import PlanningError

    config = configs.llama(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        max_position_embeddings=32768,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    gm = prepared_graph(model, (torch.zeros(1, 32768, dtype=torch.long, device="meta"),), None, fold=True)
    with pytest.raises(PlanningError, match=r"leanest layout \([^)]*sequence parallel, recomputing attention") as error:
        plan_mesh_for_graph(gm, topology="dgx-h100")
    devices = int(re.search(r"(\d+) devices \(nodes=(\d+)\) fit", str(error.value)).group(1))
    result = plan_mesh_for_graph(gm, topology="dgx-h100", nodes=devices // 8)
    assert result.choice.fits and result.choice.memory_bytes <= 0.9 * 80e9
    assert {"sequence_parallel", "selective"} <= set(result.to_dict()["choice"])
