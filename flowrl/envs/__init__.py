"""Environments and tools for multi-turn rollouts (flowrl.envs): the contract (protocol.py), the pool that runs
them (pool.py, its workers' side in host.py), finding a flow's class (load.py) and the tool shorthand (tools.py)."""

from __future__ import annotations

from flowrl.envs.load import EnvLoadError, load_env_class
from flowrl.envs.pool import EnvError, EnvPool
from flowrl.envs.protocol import ON_ERROR, Envs, EnvSpec, Outcome

__all__ = ["ON_ERROR", "EnvError", "EnvLoadError", "EnvPool", "EnvSpec", "Envs", "Outcome", "load_env_class"]
