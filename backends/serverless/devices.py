"""Devices of a serverless pool: what an instance task asks the cluster for, and which device its models use.

What a pool's instances ask for comes from what the flow asks, not from what the cluster has when the run
starts (a cluster scaled to zero has nothing yet, and its autoscaler adds what the run's tasks ask for):
- GPUs where the flow asks for them: the pool's `gpu_fraction` (that share of one GPU an instance), a model of
  its group with `gpus > 0`, or the run's device `cuda` / `cuda:N` (one GPU an instance). On a cluster without
  GPUs yet the instances' GPU requests are what its autoscaler sees;
- otherwise what the cluster has now: a GPU an instance where it has GPUs, else one logical `device_slot` (the
  custom resource that stands for a device on this project's CPU machines). The device `auto` on a joined
  cluster that has neither yet is ambiguous (which would the autoscaler add?) and an error at start, naming both
  ways to say it.
Either way an instance also asks for one CPU: a GPU's kernels are launched, its batches tokenized and its samples
drawn by a Python process, which needs a core to drive the device (on a CPU-only node the CPU is the device).

Where its models run (`choose_device`): an explicit `cpu` on the CPU; otherwise the GPU Ray assigned the task;
without one, `cuda` is an error, and `auto` runs on the CPU only on a node that has no GPU (a slot taken on a
node with GPUs would leave them idle beside a CPU run: an error naming both ways to ask). Never a silent CPU run.

Which GPU: Ray's ids (`ray.get_gpu_ids()`) name GPUs as the node sees them, so a task's device is the place of
its id among the GPUs its process sees. A worker process is reused across tasks (instance.py keeps models
warm in it), and CUDA reads CUDA_VISIBLE_DEVICES once, when the process first uses it: had Ray narrowed that
variable to each task's GPU (its default), a reused process would keep seeing the first task's GPU as cuda:0
while Ray handed the next task another one. So instance tasks ask Ray not to narrow it
(RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES): a process sees the node's GPUs all along, and a task picks its
own by place.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowrl.errors import Diagnostic, FlowError, Loc
from flowrl.ir.graph import Graph

SLOT = "device_slot"  # the Ray custom resource that stands for a device on a cluster without GPUs
GPU = "GPU"  # Ray's resource name for GPUs
NOSET = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
_SEEN: list[str | None] = []  # CUDA_VISIBLE_DEVICES as this process's first GPU task found it (CUDA's view)
_NODE_GPUS: list[float] = []  # the GPUs Ray counts on this process's node (a process stays on its node)


class DeviceError(RuntimeError):
    """An instance cannot run where it was asked to (its device, or the GPU Ray assigned it)."""


@dataclass(frozen=True)
class Devices:
    """What each instance task of a pool asks the cluster for: `gpus` of a GPU (0: a `device_slot` instead) and
    `cpus` CPUs to drive it."""

    gpus: float = 0.0
    cpus: float = 1.0

    def options(self) -> dict[str, Any]:
        """The task's Ray options (`.options(**devices.options())`)."""
        if self.gpus:
            return {"num_cpus": self.cpus, "num_gpus": self.gpus, "runtime_env": {"env_vars": {NOSET: "1"}}}
        return {"num_cpus": self.cpus, "resources": {SLOT: 1}}

    @property
    def resource(self) -> str:
        """The cluster resource that counts a pool's devices."""
        return GPU if self.gpus else SLOT

    def asks(self) -> dict[str, float]:
        """What one instance takes of the cluster's resources."""
        return {"CPU": self.cpus, self.resource: self.gpus or 1.0}

    def capacity(self, resources: Mapping[str, float]) -> int:
        """How many instances of this shape `resources` (the cluster's, or what is free of them) hold at once,
        by their devices."""
        return int(resources.get(self.resource, 0.0) / (self.gpus or 1.0) + 1e-9)


def gpus_asked(device: str, fraction: float | None = None, model_gpus: float = 0.0) -> str:
    """What in the flow asks a pool's instances to take GPUs, whatever the cluster has ("" where nothing does):
    the pool's `gpu_fraction`, a model of its group with `gpus`, or the run's device `cuda` / `cuda:N`."""
    if fraction:
        return f"gpu_fraction = {fraction:g}"
    if model_gpus > 0:
        return f"a model's gpus = {model_gpus:g}"
    if device.startswith("cuda"):
        return f'device = "{device}"'
    return ""


def devices_for(cluster: Mapping[str, float], fraction: float | None = None, cpus: float = 1.0, *,
                device: str = "auto", model_gpus: float = 0.0) -> Devices:
    """A pool's `Devices`: a GPU (or its `gpu_fraction` of one) where the flow asks for GPUs (`gpus_asked`) or,
    asking for none, where the cluster (`ray.cluster_resources()` now) has GPUs; else a device slot."""
    if gpus_asked(device, fraction, model_gpus) or cluster.get(GPU, 0) > 0:
        return Devices(float(fraction) if fraction else 1.0, cpus)
    return Devices(0.0, cpus)


def group_devices(graph: Graph, cluster: Mapping[str, float], device: str, joined: bool) -> dict[str, Devices]:
    """Each worker group's `Devices` for a run on `device` ("auto", "cpu", "cuda", "cuda:N") on a cluster with
    these resources now; `joined`: a cluster flowrl joined, which may grow (else a Ray instance flowrl started,
    which has what it has). Errors, at start rather than a wait or a CPU run: a group asking for GPUs on a local
    instance without any (nothing would ever run it), and "auto" on a joined cluster with neither GPUs nor device
    slots yet (scaled to zero: which should its autoscaler add?)."""
    pools = {p.name: p for p in graph.pools}
    out: dict[str, Devices] = {}
    for wg in graph.worker_groups:
        decl = pools.get(wg.pool or "")
        fraction = float(str(decl.options["gpu_fraction"])) if decl is not None and "gpu_fraction" in decl.options \
            else None
        gpus = {m: float(graph.model(m).gpus) for m in wg.models}
        most = max(gpus.values(), default=0.0)
        why = gpus_asked(device, fraction, most)
        if why and not joined and cluster.get(GPU, 0) <= 0:
            loc: Loc | None = None
            if fraction:
                loc = decl.loc if decl is not None else None
            elif most > 0:
                loc = graph.model(next(m for m, g in gpus.items() if g == most)).loc
            raise FlowError(Diagnostic(
                f"worker group `{wg.name}` asks for GPUs ({why}), but the Ray instance flowrl started here has "
                "none: no instance of it could ever run", loc,
                hint='join a cluster with GPUs (--address; an autoscaling one adds them on demand), or run on the '
                     'CPU: leave GPUs out (no `gpu_fraction`, no model `gpus`) and `run { device = "cpu" }`',
                source_line=line_at(loc)))
        if not why and device == "auto" and joined and cluster.get(GPU, 0) <= 0 and cluster.get(SLOT, 0) <= 0:
            raise FlowError(Diagnostic(
                f"device \"auto\" on a Ray cluster with no GPU and no `{SLOT}` yet (scaled to zero?): flowrl cannot "
                f"tell which its autoscaler should add for worker group `{wg.name}`",
                hint=f'ask for GPUs (`run {{ device = "cuda" }}`, or a pool\'s `gpu_fraction`), or for device slots '
                     f'with models on the CPU (`run {{ device = "cpu" }}`, nodes started with --resources '
                     f"'{{\"{SLOT}\": N}}')"))
        out[wg.name] = devices_for(cluster, fraction, device=device, model_gpus=most)
    return out


def line_at(loc: Loc | None) -> str | None:
    """The text of `loc`'s line in its file (None when it cannot be read), for a diagnostic's caret."""
    if loc is None or not Path(loc.path).is_file():
        return None
    lines = Path(loc.path).read_text(encoding="utf-8").splitlines()
    return lines[loc.line - 1] if 0 < loc.line <= len(lines) else None


def choose_device(requested: str, assigned: Sequence[str | int], visible: str | None,
                  node_gpus: float = 0.0) -> str:
    """The device an instance's models use: `requested` is the run's device ("auto", "cpu", "cuda", "cuda:N"),
    `assigned` the GPU ids Ray gave the task, `visible` CUDA_VISIBLE_DEVICES as the process's CUDA sees it (None:
    unset, every GPU of the node, ids are places), `node_gpus` the GPUs Ray counts on the task's node. An explicit
    "cpu" stays on the CPU; otherwise an assigned GPU is used (its place among the visible ones), and without one
    "cuda" is an error and "auto" the CPU, but only on a node without GPUs."""
    if requested == "cpu":
        return "cpu"
    if not assigned:
        if requested == "auto" and node_gpus > 0:
            raise DeviceError(f"device \"auto\": this instance took a `{SLOT}`, not a GPU, on a node with "
                              f"{node_gpus:g} GPU(s) (the cluster had no GPU when the run started, so its pools ask "
                              "for slots): its models would run on the CPU beside them. Ask for GPUs (`run { device "
                              "= \"cuda\" }`, or a pool's `gpu_fraction`), or run on the CPU on purpose (`run { "
                              "device = \"cpu\" }`)")
        if requested == "auto":
            return "cpu"
        raise DeviceError(f"device {requested!r} asked, but this instance was given no GPU: the Ray cluster "
                          "has none (its instances take a logical device_slot); run with --device auto or cpu, "
                          "or on a cluster whose nodes have GPUs")
    gpu = str(assigned[0])
    if visible is None:
        return f"cuda:{int(gpu)}"
    seen = [v.strip() for v in visible.split(",") if v.strip()]
    if gpu not in seen:
        raise DeviceError(f"Ray assigned GPU {gpu}, but this process's CUDA sees only GPUs {seen or 'none'} "
                          f"(CUDA_VISIBLE_DEVICES when it started using CUDA); the task must run with {NOSET}=1, "
                          "as instance tasks do")
    return f"cuda:{seen.index(gpu)}"


def node_gpus() -> float:
    """The GPUs Ray counts on the node this process runs on (read once: a worker process stays on its node)."""
    if not _NODE_GPUS:
        import ray

        here = ray.get_runtime_context().get_node_id()
        _NODE_GPUS.append(next((float(n["Resources"].get(GPU, 0.0)) for n in ray.nodes() if n["NodeID"] == here),
                               0.0))
    return _NODE_GPUS[0]


def task_device(requested: str, assigned: Sequence[str | int]) -> str:
    """`choose_device` in an instance task: CUDA's view is CUDA_VISIBLE_DEVICES as this process's first GPU
    task found it (CUDA reads it once); the node's GPUs are read only for an "auto" task given none."""
    if assigned and not _SEEN:
        _SEEN.append(os.environ.get("CUDA_VISIBLE_DEVICES"))
    gpus = node_gpus() if requested == "auto" and not assigned else 0.0
    return choose_device(requested, assigned, _SEEN[0] if _SEEN else os.environ.get("CUDA_VISIBLE_DEVICES"), gpus)
