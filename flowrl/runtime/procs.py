"""Data-parallel ranks in child processes (flowrl.runtime): real parallelism without Ray, for measurements.

`ProcessRanks` is a worker group of `world` ranks, each a spawned process with its own copy of the group's
models (built from the same seed). Every call runs on the ranks in parallel (no shared GIL), split by samples:
generation, forwards, and updates too, as data parallelism: the ranks form a torch.distributed (gloo) group,
so `TrainEngine` all-reduces gradients and the losses use the global mini-batch's denominators, and every rank
ends the step with the same weights. Streams (`generate_stream`, `resume_stream`) cross the pipe item by item,
with the rank's progress reports and the scheduler's export request (a multiprocessing Event) alongside, so
`flowrl.runtime.streaming` drives these ranks as it drives in-process ones. `ProcessBackend(world)` gives every
worker group such ranks; with a split placement (a model held by several groups, e.g. `actor.generate` on one
pool and `actor.update` on another) `after_update` sends the trained weights to the other holders, as the Ray
backend does. (The Ray backend is the distributed one; this is for measuring on one machine.)
"""

from __future__ import annotations

import io
import multiprocessing as mp
import pickle
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

import torch

from flowrl.engines.streaming import StreamControl
from flowrl.engines.training import merge_ranks
from flowrl.ir.graph import Graph, ModelDecl
from flowrl.runtime.chunks import STREAMS
from flowrl.runtime.protocol import Done, Future, WorkerGroup
from flowrl.runtime.ranks import SPLIT, split_call
from flowrl.runtime.worker import ModelWorker


class _Pickler(pickle.Pickler):
    """Tensors cross the pipe as numpy arrays: `Connection.send`'s pickler moves each tensor into shared memory
    and hands its file descriptor over (milliseconds a tensor), torch's own pickling goes through its
    serializer (about 1 ms to load a small batch); numpy's is ~20x cheaper for the batches a call carries."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and obj.device.type == "cpu" and not obj.requires_grad \
                and obj.dtype in _NUMPY_DTYPES:
            return _from_numpy, (obj.numpy(),)
        return NotImplemented


_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                 torch.uint8, torch.bool)


def _from_numpy(array: Any) -> torch.Tensor:
    return torch.from_numpy(array) if array.flags.writeable else torch.tensor(array)


def _send(conn: Connection, obj: Any) -> None:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    conn.send_bytes(buf.getbuffer())


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _plain(decl: ModelDecl) -> ModelDecl:
    """A picklable copy (read-only mapping proxies become dicts)."""
    return replace(decl, config=dict(decl.config), options=dict(decl.options))


class _ChildControl:
    """The rank's side of a StreamControl: progress goes up the pipe, the export request is an Event."""

    def __init__(self, conn: Connection, export: Any):
        self.conn, self.export = conn, export

    def progress(self, remaining: int) -> None:
        _send(self.conn, ("progress", remaining))

    def should_export(self) -> bool:
        return bool(self.export.is_set())


def _serve(conn: Connection, export: Any, rank: int, world: int, port: int, models: list[ModelDecl],
           every: list[ModelDecl], seed: int, device: str, threads: int) -> None:
    """A rank's process: join the data-parallel group, build the models, answer calls until told to stop."""
    if threads:
        torch.set_num_threads(threads)
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    worker = ModelWorker(models, every, seed=seed, device=device, rank=rank, world=world)
    while (msg := _recv(conn)) is not None:
        kind, method, args, kwargs = msg
        try:
            if kind == "stream":
                if kwargs.pop("control", False):
                    kwargs["control"] = _ChildControl(conn, export)
                for item in getattr(worker, method)(*args, **kwargs):
                    _send(conn, ("item", item))
                _send(conn, ("end", None))
            else:
                _send(conn, ("ok", getattr(worker, method)(*args, **kwargs)))
        except Exception as e:  # the parent re-raises it where the call was made
            _send(conn, ("error", e))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ProcessRanks:
    """`world` spawned ranks holding the models `decls` of one worker group."""

    def __init__(self, name: str, decls: Sequence[ModelDecl], every: Sequence[ModelDecl], world: int, *,
                 seed: int, device: str = "cpu", threads: int = 1):
        self.name, self.world = name, world
        self.models = [d.name for d in decls]
        self.pool = ThreadPoolExecutor(max_workers=world, thread_name_prefix=f"flowrl-{name}")
        ctx = mp.get_context("spawn")  # fork after torch has started threads is unsafe
        port = _free_port()
        self.conns: list[Connection] = []
        self.exports: list[Any] = []
        self.procs: list[Any] = []
        for rank in range(world):
            parent, child = ctx.Pipe()
            export = ctx.Event()
            proc = ctx.Process(target=_serve, daemon=True, args=(
                child, export, rank, world, port, [_plain(d) for d in decls], [_plain(d) for d in every], seed,
                device, threads))
            proc.start()
            self.conns.append(parent)
            self.exports.append(export)
            self.procs.append(proc)
        self.pads = {m: int(self.on_rank(0, "_pad", m)) for m in self.models}

    # -- calls -------------------------------------------------------------------------------------------
    @staticmethod
    def _reply(conn: Connection) -> Any:
        kind, payload = _recv(conn)
        if kind == "error":
            raise payload
        return payload

    def on_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        conn = self.conns[rank]
        if method in STREAMS:
            return self._stream(rank, method, args, kwargs)
        _send(conn, ("call", method, args, kwargs))
        return self._reply(conn)

    def _stream(self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Any]:
        control: StreamControl | None = kwargs.pop("control", None)
        export = self.exports[rank]
        export.clear()
        conn = self.conns[rank]
        _send(conn, ("stream", method, args, {**kwargs, "control": control is not None}))
        while True:
            kind, payload = _recv(conn)
            if kind == "progress":
                assert control is not None
                control.progress(payload)
                if control.should_export():
                    export.set()
            elif kind == "item":
                yield payload
            elif kind == "end":
                return
            else:
                raise payload

    def _all(self, calls: Sequence[tuple[str, tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
        """One call per rank, all at once (collectives inside need every rank)."""
        return list(self.pool.map(lambda r: self.on_rank(r, calls[r][0], *calls[r][1], **calls[r][2]),
                                  range(self.world)))

    def call(self, method: str, *args: Any, dispatch: str = "split", **kwargs: Any) -> Future:
        try:
            return Done(self._call(method, args, kwargs))
        except Exception as e:  # surfaced at result(), like a remote call's error
            return Done(error=e)

    def _call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if method in SPLIT:
            model = str(args[0])
            return split_call(self.pool, self.on_rank, self.world, self.pads[model], method, *args, **kwargs)
        if method == "update":
            model, batch, attrs = args
            shards = batch.split(self.world)
            out = self._all([("update", (model, shards[r], attrs), kwargs) for r in range(self.world)])
            return merge_ranks(out, [float(s["response_mask"].sum()) for s in shards])
        if method == "update_fused":
            models, batches, attrs = args
            shards = [b.split(self.world) for b in batches]
            out = self._all([("update_fused", (models, [s[r] for s in shards], attrs), kwargs)
                             for r in range(self.world)])
            merged = [merge_ranks([o["results"][i] for o in out], [float(s[r]["response_mask"].sum())
                                                                    for r in range(self.world)])
                      for i, s in enumerate(shards)]
            return {"results": merged, "order": out[0]["order"]}
        if method in ("load_state_dict", "load_weights"):
            return self._all([(method, args, kwargs)] * self.world)[0]
        return self.on_rank(0, method, *args, **kwargs)  # state_dict, weights: rank 0 (all ranks are equal)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.on_rank(0, "state_dict"))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._call("load_state_dict", (state,), {})

    def load_weights(self, model: str, weights: Mapping[str, torch.Tensor]) -> None:
        self._call("load_weights", (model, weights), {})

    def close(self) -> None:
        for conn in self.conns:
            _send(conn, None)
        for proc in self.procs:
            proc.join(timeout=10)
        self.pool.shutdown(wait=True)


class ProcessBackend:
    """Every worker group as `world` spawned, data-parallel ranks."""

    name = "local-processes"

    def __init__(self, world: int = 2, threads: int = 1):
        self.world, self.threads = world, threads
        self.groups: list[ProcessRanks] = []

    def start(self, graph: Graph, *, seed: int, device: str) -> dict[str, WorkerGroup]:
        groups: dict[str, WorkerGroup] = {}
        for wg in graph.worker_groups:
            group = ProcessRanks(wg.name, [graph.model(m) for m in wg.models], graph.models, self.world, seed=seed,
                                 device=device, threads=self.threads)
            self.groups.append(group)
            groups[wg.name] = group
        return groups

    def after_update(self, model: str, group: str) -> float:
        """The controller's hook after `model.update` ran in `group`: seconds spent loading the new weights into
        every rank of the other groups that hold `model` (0.0 when none does)."""
        source = next(g for g in self.groups if g.name == group)
        behind = [g for g in self.groups if g is not source and model in g.models]
        if not behind:
            return 0.0
        began = time.perf_counter()
        weights = source.on_rank(0, "weights", model)
        for g in behind:
            g.load_weights(model, weights)
        return time.perf_counter() - began

    def shutdown(self) -> None:
        for g in self.groups:
            g.close()
