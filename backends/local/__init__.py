"""The local backend: every worker group is in-process (the embedded default)."""

from flowrl.backends.local.backend import LocalBackend, in_process_groups
from flowrl.backends.local.group import InProcessGroup

__all__ = ["InProcessGroup", "LocalBackend", "in_process_groups"]
