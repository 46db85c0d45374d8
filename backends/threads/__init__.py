"""The threads backend: worker groups as in-process ranks on threads (`flowrl run FLOW --backend threads`)."""

from flowrl.backends.threads.backend import ThreadBackend

__all__ = ["ThreadBackend"]
