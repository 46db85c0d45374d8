"""The ray backend: worker groups as Ray actors in placement groups (`flowrl run FLOW --backend ray`).

`import ray` happens only under this package; `flowrl.runtime.runner.make_backend("ray")` imports it lazily.
"""

from flowrl.backends.ray.backend import RayBackend
from flowrl.backends.ray.group import RayFuture, RayWorkerGroup, WorkerError, WorkerLostError

__all__ = ["RayBackend", "RayFuture", "RayWorkerGroup", "WorkerError", "WorkerLostError"]
