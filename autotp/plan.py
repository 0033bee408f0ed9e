"""The sharding plan: plain data, saved as versioned JSON, applied by the rewriter.

Placements are stored per mesh dimension (``mesh`` names them); today the mesh is one
tensor-parallel dimension, and a data- or pipeline-parallel dimension can be added later
without changing the format of the existing entries.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autotp.passes.capture import fingerprint_difference
from autotp.placement import Shard, dump, parse

SCHEMA_VERSION = 1
SCHEMA = Path(__file__).with_name("plan.schema.json")


@functools.cache
def _validator() -> Any:
    import jsonschema

    return jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))


class PlanMismatch(ValueError):
    pass


@dataclass
class Plan:
    world_size: int
    fingerprint: str  # graph structure, constant arguments, tensor shapes it was made for
    topology: str
    nodes: dict[str, Any]  # node name -> {"in": [...], "out": ...} placements as strings
    params: dict[str, str]  # parameter name -> placement string
    collectives: list[dict[str, Any]] = field(default_factory=list)  # what the rewriter will insert, for reports
    styles: dict[str, str] = field(default_factory=dict)  # parameter name -> "column", "row", "replicate", ...
    alternatives: dict[str, Any] = field(default_factory=dict)  # node name -> the solver's options, priced
    shapes: dict[str, list[int]] = field(default_factory=dict)  # parameter name -> full shape
    replicated_ops: list[str] = field(default_factory=list)  # ops without a sharding rule (run replicated)
    quantized: dict[str, str] = field(default_factory=dict)  # parameter name -> its stored format and blocks
    cost: dict[str, Any] = field(default_factory=dict)
    mesh: dict[str, Any] = field(default_factory=lambda: {"tp": None})
    # {"path", "count"}: nodes describe blocks 0, 1, N-2, N-1; block 1 stands for 1..N-3
    fold: dict[str, Any] | None = None
    version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.mesh.get("tp") is None:
            self.mesh = {**self.mesh, "tp": self.world_size}

    def placement(self, param: str) -> Any:
        return parse(self.params[param])

    def layout(self, param: str) -> tuple[Any, int | None]:
        """(placement, full size of its sharded dim or None)."""
        placement = parse(self.params[param])
        return placement, self.shapes[param][placement.dim] if isinstance(placement, Shard) else None

    def collective_counts(self, phase: str) -> Counter[str]:
        """How many of each collective one step runs in ``phase`` (folded blocks counted as often as they run)."""
        found: Counter[str] = Counter()
        for c in self.collectives:
            if c["phase"] == phase:
                found[c["op"]] += c.get("count", 1)
        return found

    def strategy(self, node_name: str) -> tuple[list[Any], Any]:
        entry = self.nodes[node_name]
        return [parse(p) for p in entry["in"]], parse(entry["out"])

    def regathers(self, node_name: str) -> bool:
        """Whether the plan keeps this node's output, where an op keeps it gathered from tokens, as this rank's
        piece gathered again in the backward (``"regather": false``: kept whole); an older plan, which does not
        say, re-gathers every one."""
        return bool(self.nodes.get(node_name, {}).get("regather", True))

    def check(self, fingerprint: str, world_size: int) -> None:
        if self.version != SCHEMA_VERSION:
            raise PlanMismatch(
                f"plan schema version {self.version}, this autotp reads version {SCHEMA_VERSION}: "
                "re-plan with this version"
            )
        if self.world_size != world_size:
            raise PlanMismatch(
                f"plan is for world size {self.world_size}, the process group has {world_size} "
                f"ranks: launch {self.world_size} ranks or re-plan with world_size={world_size}"
            )
        if self.fingerprint != fingerprint:
            differs = fingerprint_difference(self.fingerprint, fingerprint)
            raise PlanMismatch(
                f"plan was made for another model (graph fingerprint {self.fingerprint}, this model "
                f"gives {fingerprint}{'; differing: ' + differs if differs else ''}): "
                "re-plan for this model"
            )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, validate: bool = True) -> Plan:
        """Parse and validate against plan.schema.json; say what is wrong and where.  ``validate=False``: text
        this autotp wrote itself (the plan rank 0 shares), whose schema walk costs every rank ~0.3 s."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanMismatch(f"not an autotp plan: corrupt JSON ({exc})") from exc
        if isinstance(raw, dict) and raw.get("version") not in (None, SCHEMA_VERSION):
            raise PlanMismatch(
                f"plan schema version {raw.get('version')}, this autotp reads version "
                f"{SCHEMA_VERSION}: re-plan with this version"
            )
        errors = _validator().iter_errors(raw) if validate else ()
        error = next(iter(sorted(errors, key=lambda e: list(map(str, e.path)))), None)
        if error is not None:
            where = "/".join(map(str, error.path)) or "the top level"
            raise PlanMismatch(f"not an autotp plan: at {where}: {error.message}")
        return cls(**raw)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(Path(path).read_text())

    @staticmethod
    def encode(strategy: Any) -> dict[str, Any]:
        return {"in": [dump(p) for p in strategy.inputs], "out": dump(strategy.output)}
