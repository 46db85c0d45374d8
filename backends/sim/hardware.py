"""Cluster specs for the simulator (flowrl.backends.sim): a device type, devices per node, links and a price.

A spec is a built-in name with an optional node count (`h100`, `l40s:2` = two nodes of 8 L40S) or a TOML file:

    [device]                    # one accelerator
    name = "H100-SXM"
    flops = 989e12              # dense bf16 FLOP/s
    mem_bw = 3.35e12            # HBM bytes/s
    memory_gb = 80
    [node]
    devices = 8
    intra_bw = 450e9            # bytes/s between devices of a node (NVLink, PCIe), per device
    inter_bw = 50e9             # bytes/s between nodes, per device
    [cluster]
    nodes = 4
    price_device_hour = 2.99    # money per device-hour (0: report device-seconds only)

Peak figures are the vendors' dense bf16 numbers; what a step reaches of them is the cost model's business
(`costs.Factors`), calibrated on measured runs. Prices are on-demand list prices (late 2025), for a money
column only.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flowrl.errors import Diagnostic, FlowError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI (a dependency there)
    import tomli as tomllib


@dataclass(frozen=True)
class Device:
    name: str
    flops: float  # dense bf16 FLOP/s
    mem_bw: float  # bytes/s
    memory: float  # bytes


@dataclass(frozen=True)
class Cluster:
    name: str
    device: Device
    per_node: int
    nodes: int
    intra_bw: float  # bytes/s per device inside a node
    inter_bw: float  # bytes/s per device between nodes
    price_device_hour: float = 0.0

    @property
    def devices(self) -> int:
        return self.per_node * self.nodes

    def link_bw(self, devices: int) -> float:
        """Bandwidth per device of a group of `devices` devices packed onto as few nodes as possible."""
        return self.intra_bw if devices <= self.per_node else self.inter_bw

    def money(self, device_s: float) -> float:
        return device_s / 3600.0 * self.price_device_hour


GB = 1e9
BUILTIN: dict[str, Cluster] = {
    # NVIDIA H100 SXM: 989 TFLOP/s bf16 dense, 3.35 TB/s, 80 GB; NVLink 4 (450 GB/s a direction), 400 Gb/s IB each
    "h100": Cluster("h100", Device("H100-SXM-80G", 989e12, 3.35e12, 80 * GB), 8, 1, 450e9, 50e9, 2.99),
    # H800 (RLHFuse's "Hopper"): H100 compute, NVLink cut to 400 GB/s; 8 x 200 Gb/s RoCE a node
    "h800": Cluster("h800", Device("H800-SXM-80G", 989e12, 3.35e12, 80 * GB), 8, 1, 200e9, 25e9, 2.99),
    # A100 SXM 80 GB: 312 TFLOP/s, 2.04 TB/s; NVLink 3 (300 GB/s), 200 Gb/s a device
    "a100-80g": Cluster("a100-80g", Device("A100-SXM-80G", 312e12, 2.039e12, 80 * GB), 8, 1, 300e9, 25e9, 1.79),
    # L40S: 362 TFLOP/s bf16 dense, 864 GB/s, 48 GB; PCIe 4 x16 between devices; g6e.48xlarge: 400 Gb/s a node
    "l40s": Cluster("l40s", Device("L40S-48G", 362e12, 864e9, 48 * GB), 8, 1, 25e9, 6.25e9, 1.861),
    # this machine's 2 CPU cores as one device: fp32 FMA peak of 2 cores at ~2.5 GHz with AVX-512 (nominal;
    # calibrate before trusting it)
    "cpu": Cluster("cpu", Device("CPU", 3.2e11, 2e10, 24 * GB), 1, 1, 1e10, 1e10, 0.0),
}


def _error(spec: str, why: str) -> FlowError:
    return FlowError(Diagnostic(f"cluster {spec!r}: {why}",
                                hint=f"a built-in name ({', '.join(BUILTIN)}) with an optional node count "
                                     f"(`h100:4`), or a TOML file (see `flowrl simulate --help`)"))


def load_cluster(spec: str) -> Cluster:
    """A built-in (`NAME` or `NAME:NODES`) or a TOML file's cluster."""
    path = Path(spec)
    if path.suffix == ".toml" or path.is_file():
        return _from_toml(path, spec)
    name, _, count = spec.partition(":")
    base = BUILTIN.get(name.lower())
    if base is None:
        raise _error(spec, "no such built-in cluster and no such file")
    if not count:
        return base
    if not count.isdigit() or int(count) < 1:
        raise _error(spec, f"the node count must be a positive integer, got {count!r}")
    return replace(base, name=spec, nodes=int(count))


def _num(table: dict[str, Any], key: str, spec: str, section: str, default: float | None = None) -> float:
    value = table.get(key, default)
    if value is None:
        raise _error(spec, f"[{section}] needs `{key}`")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise _error(spec, f"[{section}] {key} must be a number >= 0, got {value!r}")
    return float(value)


def _from_toml(path: Path, spec: str) -> Cluster:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise _error(spec, f"cannot read it ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise _error(spec, f"not valid TOML ({e})") from None
    dev, node, cl = (data.get(k, {}) for k in ("device", "node", "cluster"))
    if not all(isinstance(t, dict) for t in (dev, node, cl)):
        raise _error(spec, "[device], [node] and [cluster] must be tables")
    device = Device(str(dev.get("name", path.stem)), _num(dev, "flops", spec, "device"),
                    _num(dev, "mem_bw", spec, "device"), _num(dev, "memory_gb", spec, "device") * GB)
    per_node, nodes = int(_num(node, "devices", spec, "node")), int(_num(cl, "nodes", spec, "cluster", 1))
    if per_node < 1 or nodes < 1:
        raise _error(spec, "[node] devices and [cluster] nodes must be at least 1")
    return Cluster(path.stem, device, per_node, nodes, _num(node, "intra_bw", spec, "node"),
                   _num(node, "inter_bw", spec, "node"), _num(cl, "price_device_hour", spec, "cluster", 0.0))
