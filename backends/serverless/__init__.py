"""The serverless backend: elastic pools of instances that hold a device slot only while they work."""

from flowrl.backends.serverless.backend import ServerlessBackend

__all__ = ["ServerlessBackend"]
