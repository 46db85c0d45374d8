"""Where a plan runs: one folder per backend, each registered here by name (what `flowrl run --backend` offers).

A backend implements `flowrl.runtime.protocol.Backend` and its groups `WorkerGroup`, and runs calls as
`flowrl.runtime.dispatch` plans them. Register a new one with `register(name, "module:Class", help)`: the class
is imported only when the backend is made, so a backend's own dependencies (Ray) stay optional.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flowrl.errors import Diagnostic, FlowError
from flowrl.runtime.protocol import Backend


@dataclass(frozen=True)
class BackendEntry:
    name: str
    target: str  # "module:Class", imported on first use
    help: str
    extra: str | None = None  # the pip extra its imports need, named when they are missing
    options: tuple[str, ...] = ()  # the `flowrl run` options it takes (e.g. "address")


_REGISTRY: dict[str, BackendEntry] = {}


def register(name: str, target: str, help: str, *, extra: str | None = None, options: tuple[str, ...] = ()) -> None:
    _REGISTRY[name] = BackendEntry(name, target, help, extra, options)


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def entries() -> Mapping[str, BackendEntry]:
    return dict(_REGISTRY)


def make(name: str, **options: Any) -> Backend:
    """A new backend `name`, with `options` for its constructor; FlowError for an unknown name or a missing
    dependency (naming the extra to install)."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise FlowError(Diagnostic(f"unknown backend '{name}'", hint=f"use one of: {', '.join(_REGISTRY)}"))
    module_name, _, attr = entry.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        hint = f"pip install 'flowrl[{entry.extra}]'" if entry.extra else None
        raise FlowError(Diagnostic(f"the {name} backend cannot be loaded: {e}", hint=hint)) from None
    backend: Backend = getattr(module, attr)(**options)
    return backend


register("local", "flowrl.backends.local:LocalBackend",
         "every worker group in this process, one rank each (the default)")
register("threads", "flowrl.backends.threads:ThreadBackend",
         "every worker group as `replicas` ranks on threads of this process (one copy of each model)")
register("process", "flowrl.backends.process:ProcessBackend",
         "every worker group as `replicas` spawned data-parallel rank processes (no Ray)")
register("ray", "flowrl.backends.ray:RayBackend",
         "every worker group as `replicas` Ray actors in a placement group; --address joins a cluster",
         extra="ray", options=("address", "log_dir"))
register("serverless", "flowrl.backends.serverless:ServerlessBackend",
         "every worker group as an elastic pool of Ray tasks that hold a device slot only while they run; "
         "--address joins a cluster whose nodes declare `device_slot` resources",
         extra="ray", options=("address", "log_dir"))
