"""The planner's memory terms for a layout (cost_models/memory.RankMemory, from mesh_search.price_layout) held
against one real AdamW step of the runtime's model measured by PyTorch's MemTracker: each term within 25% of the
category MemTracker counts for it, at that category's largest over the step (its snapshots at every module's
entry and exit).  The two figures are independent: the planner counts the folded graph's tensors under its plan,
MemTracker the storages the step allocates."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import configs

# MemTracker's categories (torch.distributed._tools) counted for each of the planner's terms; FSDPMemTracker splits
# FSDP2's unsharded copies and their all-gather / reduce-scatter buffers from the shards
PLAIN = {
    "parameters": ("Parameter",),
    "gradients": ("Gradient",),
    "optimizer": ("Optstate",),
    "activations": ("Activation",),
}
FSDP = {
    "parameters": ("Sharded Param",),
    "gradients": ("Sharded Grad",),
    "optimizer": ("OptState",),
    "gathered_parameters": ("Unsharded Param", "All Gather"),
    "gathered_gradients": ("Unsharded Grad", "Reduce Scatter"),
    "activations": ("Activation",),
}
BATCH, SEQ = 4, 64  # one replica's batch, run at once (one micro-batch)


def _llama():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)  # six blocks: the planner folds them (passes/fold.py) and prices its FSDP unit per block
    return LlamaForCausalLM(configs.llama(num_hidden_layers=6, hidden_size=128, intermediate_size=256, vocab_size=256))


def _step(model, optimizer, x, y) -> None:
    F.cross_entropy(model(x).logits.flatten(0, 1).float(), y.flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def _measured(model, optimizer, x, y, categories: dict, tracker) -> dict[str, float]:
    """Each term's largest bytes over the snapshots of one step (every module's, and the step's end: the optimizer
    runs outside the modules), after a warm-up step (AdamW's state exists)."""
    _step(model, optimizer, x, y)
    with tracker:
        _step(model, optimizer, x, y)
    taken = [s for stats in tracker.memory_tracking.values() for each in stats.snapshots.values() for s in each]
    snapshots = [
        {str(getattr(k, "value", k)): v for k, v in snapshot.get(torch.device("cpu"), {}).items()}
        for snapshot in [*taken, tracker.get_tracker_snapshot()]
    ]
    return {term: max(sum(s.get(name, 0) for name in names) for s in snapshots) for term, names in categories.items()}


def _priced(model, layout, dp: int, data_parallel: str) -> dict[str, float]:
    from autotp.passes.prepared_graph import prepared_graph
    from autotp.planning.mesh_search import price_layout

    x = torch.zeros(2, SEQ, dtype=torch.long)  # two samples: a batch of one would be captured as fixed
    gm = prepared_graph(model, (x,), None, fold=True)
    priced = price_layout(gm, layout, global_batch=BATCH * dp, data_parallel=data_parallel)
    return priced.memory[0].terms()


def _inputs():
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def _compare(priced: dict, measured: dict) -> None:
    print({term: (round(priced[term] / 2**20, 3), round(measured[term] / 2**20, 3)) for term in measured})
    for term, bytes_measured in measured.items():
        assert bytes_measured > 0, term
        assert abs(priced[term] / bytes_measured - 1) <= 0.25, (term, priced[term], bytes_measured)


def test_one_process_terms_match_memtracker():
    """One process (TP 1, no data parallelism): the model's own eager step against the planner's terms."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from autotp.cost_models.mesh_layout import Candidate

    model, (x, y) = _llama(), _inputs()
    priced = _priced(model, Candidate(1, 1, 1, microbatch_size=BATCH), 1, "ddp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    _compare(priced, _measured(model, optimizer, x, y, PLAIN, tracker))


def _tp2_x_dp2() -> tuple[dict, dict]:
    """Rank 0 of TP 2 x DP 2 (FSDP2) on the fake process group: (the planner's terms, MemTracker's)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh

    import autotp
    from autotp.cost_models.mesh_layout import Candidate

    model, (x, y) = _llama(), _inputs()
    priced = _priced(model, Candidate(2, 1, 2, microbatch_size=BATCH), 2, "fsdp")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sharded = autotp.parallelize(model, (x,), mesh=mesh)
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    return priced, _measured(sharded, optimizer, x, y, FSDP, FSDPMemTracker(sharded, optimizer))


@pytest.mark.slow
def test_tp2_x_dp2_fsdp_terms_match_memtracker():
    """TP 2 x DP 2 with FSDP2 per block, one process playing rank 0 on the fake backend (collectives do nothing;
    every buffer they fill is allocated): shards, the gathered copies with FSDP2's communication buffers, AdamW's
    state and the activations, each against FSDPMemTracker's categories."""
    from tests.helpers.async_tp import in_fake_world

    _compare(*in_fake_world(4, _tp2_x_dp2))
