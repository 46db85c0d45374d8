"""Devices of a serverless pool: what an instance task asks the cluster for, and which device its models use.

Where the cluster has GPUs (`ray.cluster_resources()` has "GPU"), an instance task asks for `num_gpus` (1, or
the pool's `gpu_fraction`) and runs its models on the GPU Ray assigned it; elsewhere (this project's CPU
machines) it asks for one logical `device_slot`, the custom resource that stands for a device. Either way it
also asks for one CPU: a GPU's kernels are launched, its batches tokenized and its samples drawn by a Python
process, which needs a core to drive the device (on a CPU-only node the CPU is the device).

Which GPU: Ray's ids (`ray.get_gpu_ids()`) name GPUs as the node sees them, so a task's device is the place of
its id among the GPUs its process sees. A worker process is reused across tasks (instance.py keeps models
warm in it), and CUDA reads CUDA_VISIBLE_DEVICES once, when the process first uses it: had Ray narrowed that
variable to each task's GPU (its default), a reused process would keep seeing the first task's GPU as cuda:0
while Ray handed the next task another one. So instance tasks ask Ray not to narrow it
(RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES): a process sees the node's GPUs all along, and a task picks its
own by place. The choice never falls back to the CPU silently: `cuda` without an assigned GPU is an error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SLOT = "device_slot"  # the Ray custom resource that stands for a device on a cluster without GPUs
GPU = "GPU"  # Ray's resource name for GPUs
NOSET = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
_SEEN: list[str | None] = []  # CUDA_VISIBLE_DEVICES as this process's first GPU task found it (CUDA's view)


class DeviceError(RuntimeError):
    """An instance cannot run where it was asked to (its device, or the GPU Ray assigned it)."""


@dataclass(frozen=True)
class Devices:
    """What each instance task of a pool asks the cluster for: `gpus` of a GPU (0: the cluster has no GPUs, a
    `device_slot` instead) and `cpus` CPUs to drive it."""

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


def devices_for(cluster: Mapping[str, float], fraction: float | None = None, cpus: float = 1.0) -> Devices:
    """A pool's `Devices` on a cluster with these resources (`ray.cluster_resources()`): a GPU, or the pool's
    `gpu_fraction` of one, where the cluster has GPUs; a device slot where it has none."""
    if cluster.get(GPU, 0) > 0:
        return Devices(float(fraction) if fraction else 1.0, cpus)
    return Devices(0.0, cpus)


def choose_device(requested: str, assigned: Sequence[str | int], visible: str | None) -> str:
    """The device an instance's models use: `requested` is the run's device ("auto", "cpu", "cuda", "cuda:N"),
    `assigned` the GPU ids Ray gave the task, `visible` CUDA_VISIBLE_DEVICES as the process's CUDA sees it (None:
    unset, every GPU of the node, ids are places). An explicit "cpu" stays on the CPU; otherwise an assigned GPU
    is used (its place among the visible ones), and without one "auto" is the CPU and "cuda" an error."""
    if requested == "cpu":
        return "cpu"
    if not assigned:
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


def task_device(requested: str, assigned: Sequence[str | int]) -> str:
    """`choose_device` in an instance task: CUDA's view is CUDA_VISIBLE_DEVICES as this process's first GPU
    task found it (CUDA reads it once)."""
    if assigned and not _SEEN:
        _SEEN.append(os.environ.get("CUDA_VISIBLE_DEVICES"))
    return choose_device(requested, assigned, _SEEN[0] if _SEEN else os.environ.get("CUDA_VISIBLE_DEVICES"))
