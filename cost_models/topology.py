"""Hardware profiles are data: JSON files with a source next to every figure."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PROFILES = Path(__file__).parent / "topologies"
DEFAULT = "dgx-h100"


@dataclass(frozen=True)
class Topology:
    name: str
    link_latency_s: float      # per ring step inside a node
    link_bandwidth: float      # bytes/s one way per GPU inside a node
    base_latency_s: float      # fixed cost of launching one collective
    peak_flops: float          # dense bf16/fp16 FLOP/s per device
    hbm_bandwidth: float       # bytes/s per device
    memory_bytes: float        # per device


def load_topology(spec: str | Path | Topology | None = None) -> Topology:
    """A profile by name (``dgx-h100``), by path to a JSON file, or the default."""
    if isinstance(spec, Topology):
        return spec
    path = Path(spec) if spec is not None and Path(spec).suffix == ".json" else PROFILES / f"{spec or DEFAULT}.json"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in PROFILES.glob("*.json")))
        raise FileNotFoundError(f"unknown topology {spec!r}: give one of {known} or a path to a .json profile")
    raw = json.loads(path.read_text())
    try:
        return Topology(name=raw["name"], **{k: float(v["value"]) for k, v in raw["figures"].items()})
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed topology file {path}: {exc!r}; "
                         "every figure needs a 'value' and a 'source'") from exc
