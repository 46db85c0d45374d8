"""The protocols between the single controller and backends: `WorkerGroup.call(...) -> Future`.

The controller only moves `Batch`es and futures; a backend decides where a worker group's ranks live
(in-process for `local`, Ray actors for `ray`) and how a call is dispatched to them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from flowrl.ir.graph import Graph


class Future(Protocol):
    def result(self) -> Any: ...


class WorkerGroup(Protocol):
    """SPMD ranks hosting some models. `call` runs `ModelWorker.<method>(*args, **kwargs)` under
    `dispatch` ("split": data-parallel split of the batch and concatenation of results; "broadcast":
    every rank gets the whole input, rank 0's result is returned; "rank0": only rank 0 runs)."""

    name: str
    world: int

    def call(self, method: str, *args: Any, dispatch: str = "split", **kwargs: Any) -> Future: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class Backend(Protocol):
    name: str

    def start(self, graph: Graph, *, seed: int, device: str) -> dict[str, WorkerGroup]: ...

    def shutdown(self) -> None: ...


class Done:
    """An already-completed future (the local backend runs calls synchronously)."""

    def __init__(self, value: Any = None, error: BaseException | None = None):
        self._value, self._error = value, error

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value
