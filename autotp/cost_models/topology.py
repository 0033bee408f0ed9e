"""Hardware profiles are data: JSON files in topologies/, a source next to every figure.

A profile describes one node type (its GPUs, their NVLink/PCIe fabric, its NICs) and how many
nodes there are.  ``"extends": "dgx-h100"`` reuses another profile and overrides some figures,
which is how ``2x-dgx-h100`` is two DGX H100s.  Calibrated profiles (``autotp calibrate``) add
measured per-collective figures under ``measured``.  ``products`` is the device's table of measured
matrix products (each point with its source) and the figures fitted to it (cost_models/compute.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

PROFILES = Path(__file__).parent / "topologies"
DEFAULT = "dgx-h100"


@dataclass(frozen=True)
class Products:
    """How fast this device runs matrix products: ``peak_fraction`` of peak_flops plus ``overhead_s`` per kernel
    (and ``group_overhead_s`` per further group of a ragged grouped product), fitted to ``points``: measured
    (m, n, k, fraction of peak) products, [m, k] @ [k, n]."""

    peak_fraction: float
    overhead_s: float = 0.0
    group_overhead_s: float = 0.0
    points: tuple = ()


@dataclass(frozen=True)
class Topology:
    name: str
    nodes: int
    gpus_per_node: int
    memory_bytes: float  # per device
    hbm_bandwidth: float  # bytes/s per device
    peak_flops: float  # dense bf16/fp16 FLOP/s per device
    memory_efficiency: float  # achievable fraction of hbm_bandwidth
    intra_base_latency_s: float  # launch latency of one collective inside a node
    intra_step_latency_s: float  # per ring step over NVLink / PCIe
    intra_busbw: float  # ring bus bandwidth inside a node, bytes/s
    products: Products  # matrix products by shape: the profile's "products" table
    vector_flops: float = 0.0  # FP32 FLOP/s of the CUDA cores (not the tensor cores): dequantizing weights; 0: peak
    intra_busbw_nvls: float = 0.0  # in-switch reduction (NVLS) all-reduce bus bandwidth; 0 if none
    inter_base_latency_s: float = 0.0
    inter_step_latency_s: float = 0.0
    nic_bandwidth: float = 0.0  # bytes/s achieved per NIC
    nics_per_node: int = 0
    measured: dict = field(default_factory=dict)  # op -> {"latency_s", "busbw", "points"} from calibration

    @property
    def devices(self) -> int:
        return self.nodes * self.gpus_per_node


def _figures(raw: dict, path: Path) -> dict:
    """{"key": {"value": v, "source": "..."}} -> {"key": v}; a figure without a source is refused."""
    out = {}
    for key, entry in raw.items():
        if not isinstance(entry, dict) or "value" not in entry or not entry.get("source"):
            raise ValueError(f"malformed topology file {path}: figure {key!r} needs a 'value' and a 'source'")
        out[key] = entry["value"]
    return out


def _read(path: Path, seen: tuple = ()) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read topology file {path}: {exc}") from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("figures", {}), dict):
        raise ValueError(f"malformed topology file {path}: expected an object with 'name' and 'figures'")
    base: dict = {}
    if "extends" in raw:
        parent = _resolve(raw["extends"])
        if parent in seen:
            raise ValueError(f"topology file {path} extends itself through {parent}")
        base = _read(parent, (*seen, path))
    figures = {**base.get("figures", {}), **_figures(raw.get("figures", {}), path)}
    products = _products(raw["products"], path) if "products" in raw else base.get("products")
    return {
        "name": raw.get("name", path.stem),
        "figures": figures,
        "measured": raw.get("measured", {}),
        "products": products,
    }


POINT = ("m", "n", "k", "fraction")


def _products(raw: dict, path: Path) -> Products:
    """The "products" table: fitted figures with sources, and the measured points, each with its source."""
    points = raw.get("points", [])
    if not isinstance(points, list) or not all(
        isinstance(p, dict) and p.get("source") and all(isinstance(p.get(key), (int, float)) for key in POINT)
        for p in points
    ):
        raise ValueError(f"malformed topology file {path}: each product point needs m, n, k, fraction and a source")
    figures = _figures({k: v for k, v in raw.items() if k not in ("points", "held_out")}, path)
    try:
        return Products(**figures, points=tuple(tuple(p[key] for key in POINT) for p in points))
    except TypeError as exc:
        raise ValueError(f"malformed topology file {path}: products: {exc}") from exc


def _legacy_products(figures: dict) -> Products | None:
    """A profile written before product tables: its flat ``matmul_efficiency``, no overhead."""
    flat = figures.pop("matmul_efficiency", None)
    return Products(flat) if flat is not None else None


def _resolve(spec: str | Path) -> Path:
    path = Path(spec)
    if path.suffix == ".json":
        if not path.exists():
            raise FileNotFoundError(
                f"topology file {path} does not exist; give a profile's name or the path of a .json profile"
            )
        return path
    path = PROFILES / f"{spec}.json"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in PROFILES.glob("*.json")))
        raise FileNotFoundError(f"unknown topology {spec!r}; give one of {known} or a path to a .json profile")
    return path


def load_topology(spec: str | Path | Topology | None = None, nodes: int | None = None) -> Topology:
    """A profile by name (``dgx-h100``), by path to a JSON file, or the default; ``nodes``: a cluster
    of that many of its nodes (``load_topology("dgx-a100", nodes=128)``)."""
    if isinstance(spec, Topology):
        topo = spec
    else:
        path = _resolve(spec or DEFAULT)
        raw = _read(path)
        figures = dict(raw["figures"])
        products = _legacy_products(figures) if raw["products"] is None else raw["products"]
        figures.pop("matmul_efficiency", None)
        if products is None:
            raise ValueError(
                f"topology file {path} has no 'products' table: add one (docs/cost-model.md) or run "
                "autotp calibrate on the device"
            )
        try:
            topo = Topology(name=raw["name"], measured=raw["measured"], products=products, **figures)
        except TypeError as exc:
            raise ValueError(f"malformed topology file {path}: {exc}") from exc
    if nodes is None or nodes == topo.nodes:
        return topo
    if not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be a positive integer, got {nodes!r}")
    if nodes > 1 and not topo.nics_per_node:
        raise ValueError(
            f"topology {topo.name} has no NICs (nics_per_node) to join {nodes} nodes: "
            "give a profile with network figures"
        )
    return replace(topo, name=f"{topo.name} x{nodes}", nodes=nodes)


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES.glob("*.json"))
