"""Options are typed values built once at the public boundary: a misspelt or misplaced one fails in one line
before anything runs, every field says what it is for, and the memory default is written once."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import autotp
from autotp.cost_models import load_topology
from autotp.cost_models.memory import USABLE_FRACTION, memory_limit
from autotp.options import MeshOptions, PlanOptions, RunOptions, SearchOptions, from_keywords

OPTIONS = Path(autotp.__file__).with_name("options.py")


def test_keywords_are_sorted_into_their_values():
    planning, running, meshing = from_keywords({"topology": "dgx-a100", "timeout": 5.0, "schedule": "GPipe"})
    assert (planning.topology, running.timeout, meshing.schedule) == ("dgx-a100", 5.0, "GPipe")
    assert planning == PlanOptions(topology="dgx-a100") and meshing == MeshOptions(schedule="GPipe")


def test_a_misspelt_option_fails_in_one_line_naming_the_valid_ones():
    with pytest.raises(TypeError) as caught:
        autotp.parallelize(torch.nn.Linear(2, 2), (torch.zeros(1, 2),), sequence_paralel=True)
    message = str(caught.value)
    assert "\n" not in message and "sequence_paralel" in message and "sequence_parallel" in message
    with pytest.raises(TypeError, match="plan\\(\\) got unknown option\\(s\\) timeout"):
        autotp.plan(torch.nn.Linear(2, 2), (torch.zeros(1, 2),), world_size=2, timeout=5)
    with pytest.raises(TypeError, match="plan_mesh\\(\\) got unknown option\\(s\\) world_size"):
        autotp.plan_mesh(torch.nn.Linear(2, 2), (torch.zeros(1, 2),), world_size=2)


def test_a_bad_value_fails_where_its_value_is_built():
    with pytest.raises(ValueError, match="recompute"):
        PlanOptions(recompute="full")
    with pytest.raises(ValueError, match="check_inputs"):
        RunOptions(check_inputs="sometimes")
    with pytest.raises(ValueError, match="data_parallel"):
        SearchOptions(data_parallel="zero3")
    with pytest.raises(ValueError, match="compose a DeviceMesh"):
        autotp.parallelize(torch.nn.Linear(2, 2), (torch.zeros(1, 2),), loss_fn=print)


def test_options_are_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PlanOptions().training = False
    with pytest.raises(TypeError):
        PlanOptions("dgx-h100")


def test_every_field_has_a_docstring():
    tree = ast.parse(OPTIONS.read_text())
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Options")]
    assert {c.name for c in classes} == {"PlanOptions", "RunOptions", "MeshOptions", "SearchOptions"}
    for cls in classes:
        body = cls.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign):
                following = body[i + 1] if i + 1 < len(body) else None
                assert isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant), (
                    f"{cls.name}.{stmt.target.id} has no docstring"
                )


def test_the_memory_limit_is_one_fraction_of_the_device():
    topology = load_topology("dgx-h100")
    assert memory_limit(topology) == USABLE_FRACTION * topology.memory_bytes
    assert memory_limit(topology, 1e9) == 1e9
    assert 0 < USABLE_FRACTION < 1
