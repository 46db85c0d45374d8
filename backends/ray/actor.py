"""One rank of a worker group: a Ray actor process hosting a `ModelWorker` (the ray backend's SPMD unit).

The actor is a thin shell: it builds the same `ModelWorker` the local backend runs in-process, joins the
group's `torch.distributed` process group (gloo on CPU, NCCL on GPU) and runs methods by name. Exceptions keep
their type and carry the worker's own traceback (`remote_traceback`) for the controller's error message.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import traceback
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import ray
import torch

from flowrl.ir.graph import ModelDecl
from flowrl.runtime.chunks import STREAMS
from flowrl.runtime.dispatch import MODEL_CALLS
from flowrl.runtime.worker import ModelWorker, drop_inherited_rendezvous

TICK_S = 0.02  # a stream pull returns at least this often, carrying the rank's progress
DIST_TIMEOUT = timedelta(seconds=120)  # a collective that waits longer than this has lost a peer


class RankActor:
    """`crash_on_call` is a test-only hook: `n` makes this process exit (as if killed) at its n-th model call;
    `(method, n)` at its n-th call of `method` (a stream, `generate_stream`, exits once it has handed over its
    first item: a rank lost mid-stream)."""

    def __init__(self, models: Sequence[ModelDecl], all_models: Sequence[ModelDecl], *, seed: int, device: str,
                 rank: int, world: int, threads: int = 1, crash_on_call: int | tuple[str, int] | None = None):
        torch.set_num_threads(max(1, threads))
        drop_inherited_rendezvous()  # a Ray worker has the environment of the driver that started Ray
        self.rank, self.world = rank, world
        self.crash_on_call = crash_on_call
        self.calls = 0
        self.by_method: dict[str, int] = {}
        self._items: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._pulled = _PulledControl()  # the open stream's progress and export request
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

    def _crash_due(self, method: str) -> bool:
        """Count a call; True when it is the one the test hook `crash_on_call` names."""
        self.by_method[method] = self.by_method.get(method, 0) + 1
        if isinstance(self.crash_on_call, tuple):
            return self.crash_on_call == (method, self.by_method[method])
        if method not in MODEL_CALLS:
            return False
        self.calls += 1
        return self.crash_on_call is not None and self.calls == self.crash_on_call

    def run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method not in STREAMS and self._crash_due(method):
            os._exit(1)
        try:
            return getattr(self.worker, method)(*args, **kwargs)
        except Exception as e:
            try:
                e.remote_traceback = traceback.format_exc()  # type: ignore[attr-defined]
            except AttributeError:  # an exception type with __slots__: Ray's traceback is used instead
                pass
            raise

    # ---- streams: fuse-gen-inference pulls a rank's chunks one by one (RayWorkerGroup.on_rank) -------
    def stream_open(self, method: str, args: Sequence[Any], kwargs: dict[str, Any], controlled: bool) -> None:
        """Start `method` (generate_stream / resume_stream) on a thread of this actor; with `controlled`, its
        StreamControl reports the rank's unfinished rows and reads the export request of the last pull."""
        self._pulled = _PulledControl()
        if controlled:
            kwargs = {**kwargs, "control": self._pulled}
        items: queue.Queue[tuple[str, Any]] = queue.Queue()
        crash = self._crash_due(method)  # the test hook: exit once the stream has handed over its first item

        def produce() -> None:
            try:
                for item in self.run(method, *args, **kwargs):
                    items.put(("item", item))
                    if crash:
                        while not items.empty():  # until the scheduler has pulled it: then die mid-stream
                            threading.Event().wait(TICK_S)
                        os._exit(1)
                items.put(("end", None))
            except BaseException as e:  # re-raised by the pull that finds it
                items.put(("error", e))

        self._items = items
        threading.Thread(target=produce, name=f"flowrl-{method}", daemon=True).start()

    def stream_next(self, export: bool) -> tuple[str, Any, int | None]:
        """The stream's next item ("item", x, rows left), its end ("end", None, rows left), or, when none came
        within TICK_S, ("tick", None, rows left): the scheduler sees progress and can ask for an export then."""
        self._pulled.export = export
        try:
            kind, item = self._items.get(timeout=TICK_S)
        except queue.Empty:
            return "tick", None, self._pulled.remaining
        if kind == "error":
            raise item
        return kind, item, self._pulled.remaining

    def stats(self) -> dict[str, Any]:
        """What this rank has done (tests use it to see which ranks a dispatch mode ran)."""
        return {"rank": self.rank, "world": self.world, "calls": self.calls, "pid": os.getpid(),
                "threads": torch.get_num_threads()}


class _PulledControl:
    """A StreamControl inside the actor, holding what the actor and its stream share: progress, kept for the
    next `stream_next` reply, and the export request, the flag the last `stream_next` call brought (so it is seen
    at the next decode step after it)."""

    def __init__(self) -> None:
        self.export = False  # the export request the last stream_next brought
        self.remaining: int | None = None  # the stream's last progress report

    def progress(self, remaining: int) -> None:
        self.remaining = remaining

    def should_export(self) -> bool:
        return self.export
