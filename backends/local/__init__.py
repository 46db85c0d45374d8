"""The local backend: every worker group is in-process (the embedded default)."""

from flowrl.backends.local.backend import LocalBackend, LocalWorkerGroup

__all__ = ["LocalBackend", "LocalWorkerGroup"]
