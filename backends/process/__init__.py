"""The process backend: worker groups as spawned data-parallel rank processes (`--backend process`)."""

from flowrl.backends.process.backend import ProcessBackend
from flowrl.backends.process.group import ProcessRanks

__all__ = ["ProcessBackend", "ProcessRanks"]
