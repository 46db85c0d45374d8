"""The models a serverless worker process keeps between instance tasks, and where they wait: a bounded set of
(run, worker group) entries, least recently used evicted first, each on the device while a task holds it and
in host memory between tasks.

An instance gives its device back when its task returns; its models must not stay there (the memory would be
held while the cost report says released, and the next task Ray schedules on that GPU would find it taken). So
a task ends by moving its models to host memory (pinned where CUDA exists, so the next move back is a DMA) and
the next task that needs them moves them back onto the device it was given, timed as loading. A pool with
`keep_warm = "device"` skips both moves: its models stay on the device between tasks, which the process
keeps holding (the task stats say so; Ray counts that GPU free). Where no GPU exists both moves are CPU to CPU,
no copy, the same code path.
"""

from __future__ import annotations

import gc
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from flowrl.engines.prompt_cache import cache_of, weights_changed
from flowrl.engines.training import TrainEngine
from flowrl.runtime.worker import ModelWorker

KEPT = 2  # (run, group) entries a worker process keeps: a pool's group and one other sharing its processes


@dataclass
class Entry:
    worker: ModelWorker
    versions: dict[str, int] = field(default_factory=dict)


class ProcessModels:
    """A worker process's entries, least recently used first; an entry evicted (over `kept`, or of an earlier
    run) is freed: its tensors dropped, collected, CUDA's cached blocks returned."""

    def __init__(self, kept: int = KEPT):
        self.kept = kept
        self.entries: OrderedDict[tuple[str, str], Entry] = OrderedDict()

    def get(self, key: tuple[str, str]) -> Entry | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def put(self, key: tuple[str, str], entry: Entry) -> None:
        """Keep `entry` as the most recently used; evict earlier runs' entries (this process serves a new run)
        and the least recently used beyond `kept`."""
        stale = [k for k in self.entries if k[0] != key[0]]
        self.entries[key] = entry
        self.entries.move_to_end(key)
        while len(self.entries) > self.kept:
            stale.append(next(iter(self.entries)))
            self.entries.pop(stale[-1])
        self.drop(*stale)

    def clear(self) -> None:
        self.drop(*self.entries)

    def drop(self, *keys: tuple[str, str]) -> None:
        gone = [self.entries.pop(k, None) for k in keys]
        if any(g is not None for g in gone):
            del gone
            free()


def free() -> None:
    """Return what dropped tensors held: collected now, and CUDA's cached blocks back to the device."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # cuBLAS keeps a workspace per stream
        if clear is not None:
            clear()
        torch.cuda.empty_cache()


def _moved(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    if device.type == "cpu":
        out = t.to(device)
        return out.pin_memory() if pin and not out.is_pinned() else out
    return t.to(device, non_blocking=True)


def why_not_movable(worker: ModelWorker) -> str:
    """Why `worker`'s models cannot move between host and device ("" when they can): vLLM and DeepSpeed
    engines place their own memory."""
    if worker.generators:
        return "a vLLM engine keeps its own device memory"
    if any(not isinstance(t, TrainEngine) for t in worker.trainers.values()):
        return "a DeepSpeed engine keeps its own device memory"
    return ""


def move_models(worker: ModelWorker, device: str | torch.device) -> float:
    """Move `worker`'s models, their optimizers' state and its own device to `device` (to the host: pinned where
    CUDA exists; the models' cached prompts are dropped) -> seconds. The parameters stay the same objects (the
    optimizers keep them), only their data moves."""
    began = time.perf_counter()
    to = torch.device(device)
    pin = to.type == "cpu" and torch.cuda.is_available()
    for loaded in worker.models.values():
        module = loaded.module
        for p in module.parameters():
            p.data = _moved(p.data, to, pin)
            if p.grad is not None:
                p.grad = _moved(p.grad, to, pin)
        for mod in module.modules():
            for name, b in mod._buffers.items():
                if b is not None:
                    mod._buffers[name] = _moved(b, to, pin)
        if to != worker.device:  # cached prompt states (KV rows) were computed on the old device
            weights_changed(module)
            cache_of(module)
    for trainer in worker.trainers.values():
        assert isinstance(trainer, TrainEngine)  # why_not_movable() said so
        for state in trainer.optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and k != "step":  # AdamW keeps its step count on the host
                    state[k] = _moved(v, to, pin)
    worker.device = to
    if to.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(to)
    return time.perf_counter() - began
