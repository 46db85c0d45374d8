"""One rank of a worker group: a Ray actor process hosting a `ModelWorker` (the ray backend's SPMD unit).

The actor is a thin shell: it builds the same `ModelWorker` the local backend runs in-process, joins the
group's `torch.distributed` process group (gloo on CPU, NCCL on GPU) and runs methods by name. Exceptions keep
their type and carry the worker's own traceback (`remote_traceback`) for the controller's error message.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import ray
import torch

from flowrl.backends.ray.dispatch import MODEL_CALLS
from flowrl.ir.graph import ModelDecl
from flowrl.runtime.worker import ModelWorker

DIST_TIMEOUT = timedelta(seconds=120)  # a collective that waits longer than this has lost a peer


class RankActor:
    """`crash_on_call=n` is a test-only hook: this process exits (as if killed) at its n-th model call."""

    def __init__(self, models: Sequence[ModelDecl], all_models: Sequence[ModelDecl], *, seed: int, device: str,
                 rank: int, world: int, threads: int = 1, crash_on_call: int | None = None):
        torch.set_num_threads(max(1, threads))
        self.rank, self.world = rank, world
        self.crash_on_call = crash_on_call
        self.calls = 0
        self.worker = ModelWorker(models, all_models, seed=seed, device=device, rank=rank, world=world)

    def ready(self) -> int:
        return os.getpid()

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port, for rank 0 to host the process group's rendezvous."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return ray.util.get_node_ip_address(), port

    def join(self, host: str, port: int) -> None:
        """Join the group's process group (all ranks call this together)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        backend = "nccl" if self.worker.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=self.world, timeout=DIST_TIMEOUT)

    def run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method in MODEL_CALLS:
            self.calls += 1
            if self.crash_on_call is not None and self.calls == self.crash_on_call:
                os._exit(1)
        try:
            return getattr(self.worker, method)(*args, **kwargs)
        except Exception as e:
            try:
                e.remote_traceback = traceback.format_exc()  # type: ignore[attr-defined]
            except AttributeError:  # an exception type with __slots__: Ray's traceback is used instead
                pass
            raise

    def stats(self) -> dict[str, Any]:
        """What this rank has done (tests use it to see which ranks a dispatch mode ran)."""
        return {"rank": self.rank, "world": self.world, "calls": self.calls, "pid": os.getpid(),
                "threads": torch.get_num_threads()}
