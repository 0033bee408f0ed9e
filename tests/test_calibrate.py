"""Calibration on real gloo ranks: the fitted profile predicts the measured collectives."""
from __future__ import annotations

import autotp
from autotp.cost_models import load_topology
from autotp.tools.calibrate import calibrate, comparison
from distributed import run_ranks
from models import build


def _calibrate(rank: int, world: int, out: str) -> None:
    calibrate(out)


def test_calibrated_profile_predicts_measured_times(tmp_path):
    out = tmp_path / "calibrated.json"
    run_ranks(2, _calibrate, str(out))
    topo = load_topology(out)
    assert topo.devices == 2 and set(topo.measured) == {"all_reduce", "all_gather", "reduce_scatter"}
    rows, median = comparison(out)
    assert {r[1] for r in rows} == {4096 * 4 ** k for k in range(8)}  # 4 KiB .. 64 MiB
    print(f"calibrated median error {median:.1%}")
    assert median <= 0.25
    model, args, _ = build("mlp")
    plan = autotp.plan(model, args, world_size=2, topology=out)
    assert plan.topology == topo.name and plan.collectives[0]["seconds"] > 0
