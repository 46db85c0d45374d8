"""Process ranks (process backend): a worker group as `world` forked processes, each with its own copy of the
group's models (built from the same seed): real parallelism without Ray, on one machine.

Calls are planned by `flowrl.runtime.dispatch` and run on the ranks at once (no shared GIL): generation, forwards,
and updates too, as data parallelism: the ranks form a torch.distributed (gloo) group, so `TrainEngine`
all-reduces gradients and the losses use the global mini-batch's denominators, and every rank ends the step with
the same weights. Streams (`generate_stream`, `resume_stream`) cross the pipe item by item, with the rank's
progress reports and the scheduler's export request (a multiprocessing Event) alongside, so the fused stage's
scheduler drives these ranks as it drives in-process ones. A rank that dies is not restarted (the Ray backend is
the fault-tolerant one): the step fails with the pipe's error.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import pickle
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch

from flowrl.engines.chunked_generation import StreamControl
from flowrl.ir.graph import ModelDecl, Node
from flowrl.runtime import dispatch
from flowrl.runtime.batch import Batch
from flowrl.runtime.chunks import STREAMS
from flowrl.runtime.protocol import Future, StreamedStage, WorkerGroup, done
from flowrl.runtime.worker import ModelWorker, drop_inherited_rendezvous


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


def _context() -> Any:
    """Ranks fork from a server process that has imported this module (torch, transformers, the worker) once: a
    spawned rank spent about 2 s of CPU importing them. The server only imports, so no thread pool has run when it
    forks; forking the parent instead, after torch has started threads, is unsafe."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # read when the server starts (this process's first rank)
    return ctx


def _serve(conn: Connection, export: Any, env: dict[str, str], rank: int, world: int, port: int,
           models: list[ModelDecl], every: list[ModelDecl], seed: int, device: str, threads: int) -> None:
    """A rank's process: join the data-parallel group, build the models, answer calls until told to stop. `env`:
    the parent's environment when it started the rank (the fork server's is the one it had when it started)."""
    os.environ.clear()
    os.environ.update(env)
    if threads:
        torch.set_num_threads(threads)
    drop_inherited_rendezvous()
    if world > 1:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=_STORE_TIMEOUT)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    worker = ModelWorker(models, every, seed=seed, device=device, rank=rank, world=world)
    while True:
        try:
            msg = _recv(conn)
        except EOFError:  # the parent is gone
            break
        except Exception as e:  # a call this rank cannot unpickle: said to the caller, who waits for an answer
            _send(conn, ("error", RuntimeError(f"rank {rank} could not read the call: {type(e).__name__}: {e}")))
            continue
        if msg is None:
            break
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
            try:
                _send(conn, ("error", e))
            except Exception:  # an exception that does not pickle: its type and text, rather than no answer
                _send(conn, ("error", RuntimeError(f"{type(e).__name__}: {e}")))
    worker.close()  # told to stop: its environment pools' processes end now, not when this one exits


_STORE_TIMEOUT = timedelta(minutes=10)


def _store() -> Any:
    """The ranks' rendezvous, held by the parent on a port the kernel chose while it listens (a port found free and
    then handed to the ranks can be taken in between)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, is_master=True, timeout=_STORE_TIMEOUT, wait_for_workers=False)


class ProcessRanks:
    """`world` spawned ranks holding the models `decls` of one worker group."""

    inline = False
    per_rank = True
    why_not_per_rank = ""

    def __init__(self, name: str, decls: Sequence[ModelDecl], every: Sequence[ModelDecl], world: int, *,
                 seed: int, device: str = "cpu", threads: int = 1):
        self.name, self.world = name, world
        self.models = tuple(d.name for d in decls)
        self.pool = ThreadPoolExecutor(max_workers=world, thread_name_prefix=f"flowrl-{name}")
        ctx = _context()
        self.store = _store() if world > 1 else None
        port = self.store.port if self.store is not None else 0
        self.conns: list[Connection] = []
        self.exports: list[Any] = []
        self.procs: list[Any] = []
        for rank in range(world):
            parent, child = ctx.Pipe()
            export = ctx.Event()
            proc = ctx.Process(target=_serve, daemon=True, args=(
                child, export, dict(os.environ), rank, world, port, [_plain(d) for d in decls],
                [_plain(d) for d in every], seed, device, threads))
            proc.start()
            child.close()  # the rank's end lives in the rank alone: its exit is then an EOF here, not a silence
            self.conns.append(parent)
            self.exports.append(export)
            self.procs.append(proc)
        self.pads = {m: int(self.on_rank(0, "pad_id", m)) for m in self.models}

    # -- calls -------------------------------------------------------------------------------------------
    def _read(self, rank: int) -> Any:
        """The next message from `rank`; a rank that ended without answering (killed, or crashed outside a call) is
        an error naming it, never a wait that does not end."""
        try:
            return _recv(self.conns[rank])
        except (EOFError, ConnectionResetError, BrokenPipeError):
            raise self._ended(rank) from None

    def _write(self, rank: int, msg: Any) -> None:
        try:
            _send(self.conns[rank], msg)
        except (ConnectionResetError, BrokenPipeError):
            raise self._ended(rank) from None

    def _ended(self, rank: int) -> RuntimeError:
        proc = self.procs[rank]
        proc.join(timeout=10)
        return RuntimeError(f"rank {rank} of worker group `{self.name}` ended (exit code {proc.exitcode}) before it "
                            f"answered")

    def _reply(self, rank: int) -> Any:
        kind, payload = self._read(rank)
        if kind == "error":
            raise payload
        return payload

    def on_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        if method in STREAMS:
            return self._stream(rank, method, args, kwargs)
        self._write(rank, ("call", method, args, kwargs))
        return self._reply(rank)

    def _stream(self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Any]:
        control: StreamControl | None = kwargs.pop("control", None)
        export = self.exports[rank]
        export.clear()
        self._write(rank, ("stream", method, args, {**kwargs, "control": control is not None}))
        while True:
            kind, payload = self._read(rank)
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

    def call(self, method: str, *args: Any, dispatch: str = "split", **kwargs: Any) -> Future:
        return done(self._call, method, args, kwargs, dispatch)

    def _call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], mode: str) -> Any:
        p = dispatch.plan(method, args, kwargs, mode, self.world)
        results = dispatch.run_plan(p, lambda c: self.on_rank(c.rank, method, *c.args, **c.kwargs), self.pool)
        pad = self.pads.get(args[0], 0) if method == "generate" and args else 0
        return dispatch.merge(p, results, pad)

    def colocated(self, models: Sequence[str]) -> bool:
        return all(m in self.models for m in models)  # each rank's models share its one process

    def stream_stage(self, gen: Node, forwards: Sequence[Node], prompts: Batch, seed: int,
                     others: Mapping[str, WorkerGroup]) -> StreamedStage | None:
        return None  # its ranks are driven one by one (per_rank)

    def recover(self) -> None:
        """Process ranks are not restarted (see the module docstring)."""

    def state_dict(self) -> dict[str, Any]:
        # Every rank takes part (a ZeRO trainer gathers its partitions onto rank 0); rank 0's is the whole state.
        return dict(self._call("state_dict", (), {}, "broadcast"))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._call("load_state_dict", (state,), {}, "broadcast")

    def load_weights(self, model: str, weights: Mapping[str, torch.Tensor]) -> None:
        self._call("load_weights", (model, weights), {}, "broadcast")

    def close(self) -> None:
        for conn in self.conns:
            _send(conn, None)
        for proc in self.procs:
            proc.join(timeout=10)
        self.pool.shutdown(wait=True)
        self.store = None  # the rendezvous stops listening
